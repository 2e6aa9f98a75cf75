"""`xffl watch`: follow a run until it ends, as `xffl submit --wait` does, from any shell."""

from __future__ import annotations

from typing import Annotated

import typer

from xffl.cli.common import (
    console,
    err_console,
    error_json,
    handle_errors,
    markup_safe,
    print_json,
    resolve_run,
)
from xffl.cli.options import JsonOpt, RunArg
from xffl.core.errors import ExitCode, InvalidInput
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry

TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", min=0, help="Stop following after this many seconds (exit 4; the run goes "
    "on).")]


def copies(run: RunRecord) -> list[str]:
    """One line per site's update or global in flight: bytes so far, MB/s, ETA."""
    from xffl.jobs.inflight import copies_in_flight

    return [c.describe() for c in copies_in_flight(run.run_dir)]


def latest_loss(registry: Registry, run: RunRecord) -> str:
    """The loss of the run's latest completed round, training and validation where known:
    ``round 2 loss 3.1462 val loss 3.5974``; empty before the first one."""
    done = [r for r in registry.rounds(run.id) if r.state == "completed" and r.loss is not None]
    if not done:
        return ""
    last = done[-1]
    return f"round {last.round} loss {last.loss:.4f}" + (
        f" val loss {last.val_loss:.4f}" if last.val_loss is not None else "")


def follow(registry: Registry, run: RunRecord, timeout: float, *, as_json: bool = False,
           spawned: int | None = None, intro: str = "") -> RunRecord:
    """Wait for ``run`` to end: a progress bar on a terminal, one line per change in a pipe,
    after the markup line ``intro`` (not under ``as_json``). Ctrl-C from the intro on stops
    following, not the run: exit 130, saying how to follow or cancel it."""
    try:
        if intro and not as_json:
            console.print(f"{intro} (Ctrl-C stops following, not the run)", soft_wrap=True)
        return _follow(registry, run, timeout, as_json, spawned)
    except KeyboardInterrupt:
        message = (f"interrupted: run {run.id} goes on; follow it with `xffl watch {run.id}`, "
                   f"cancel it with `xffl cancel {run.id}`.")
        err_console.print(message, soft_wrap=True, markup=False)
        if as_json:
            error_json(ExitCode.INTERRUPTED, message)
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None


def _follow(registry: Registry, run: RunRecord, timeout: float, as_json: bool,
            spawned: int | None) -> RunRecord:
    """:func:`follow`, its Ctrl-C aside; the latest round's loss beside the round counts."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from xffl.jobs.follow import wait_for_run

    if as_json:
        return wait_for_run(registry, run.id, timeout, spawned=spawned)
    losses: dict[int, str] = {}

    def loss(r: RunRecord) -> list[str]:
        """The latest loss, read from the registry once per completed round."""
        if r.rounds_done not in losses:
            losses[r.rounds_done] = latest_loss(registry, r)
        return [losses[r.rounds_done]] if losses[r.rounds_done] else []

    if not console.is_terminal:  # a log file or a pipe: plain lines, flushed as they come
        seen: list[tuple[str, int]] = []

        def line(r: RunRecord) -> None:
            if not seen or seen[-1] != (r.state, r.rounds_done):
                seen.append((r.state, r.rounds_done))
                console.print("; ".join([f"{r.id} {r.state} {r.rounds_done}/{r.rounds_total} "
                                         "rounds", *loss(r)]), soft_wrap=True, markup=False)
            for text in copies(r):
                console.print(f"{r.id} {text}", soft_wrap=True, markup=False)
            console.file.flush()

        return wait_for_run(registry, run.id, timeout, on_update=line, spawned=spawned)
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} rounds"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task(run.state, total=run.rounds_total)

        def update(r: RunRecord) -> None:
            label = r.state if r.finished else f"{r.state}: round {r.rounds_done + 1}"
            label = "; ".join([label, *loss(r), *copies(r)])
            progress.update(task, completed=r.rounds_done, description=label)

        return wait_for_run(registry, run.id, timeout, on_update=update, spawned=spawned)


def outcome(registry: Registry, final: RunRecord, as_json: bool) -> None:
    """Print how the run ended (its status under --json); exit 1 unless it completed."""
    from xffl.jobs.status import latest_global, run_status

    if as_json:
        print_json(run_status(registry, final, slurm=True, live=False).as_json())
    elif final.state == RunState.COMPLETED:
        console.print(f"[green]run {final.id} completed[/green]: {final.rounds_done} rounds.")
        console.print(f"final global model: {latest_global(registry, final)}", soft_wrap=True)
        console.print(f"next: `xffl status {final.id}` shows every round and site.",
                      soft_wrap=True)
    else:
        console.print(f"[red]run {final.id} {final.state}[/red]: {markup_safe(final.message)}",
                      soft_wrap=True)
        console.print(f"next: `xffl status {final.id}`, and the logs in {final.run_dir}.",
                      soft_wrap=True)
    if final.state != RunState.COMPLETED:
        raise typer.Exit(int(ExitCode.RUN_FAILED))


def _something_to_follow(run: RunRecord) -> None:
    """Refuse (exit 2) a waiting run that no process runs and no cron entry ticks: following
    it would wait until --timeout (a day by default) for nothing."""
    from xffl.jobs.schedule import current
    from xffl.jobs.status import runner_alive

    if run.state != RunState.WAITING or runner_alive(run) or current(run.id) is not None:
        return
    raise InvalidInput(
        f"run {run.id} is waiting and nothing runs it (no runner, no cron entry): "
        f"`xffl round {run.id}` runs its next round, `xffl schedule {run.id} --cron "
        f"'*/30 * * * *'` one per tick, `xffl resume {run.id} --wait` all of them.")


@handle_errors
def watch(
    run: RunArg = "last",
    timeout: TimeoutOpt = 86400.0,
    as_json: JsonOpt = False,
) -> None:
    """Follow a run until it ends: a progress bar on a terminal, one line per round in a pipe.

    Beside the round counts, the latest round's training and validation loss.

    Exit 0 when it completed, 1 when it failed or was cancelled, 4 after --timeout, 130 on
    Ctrl-C (it stops following, not the run, and says how to follow or cancel it); 2 at
    once for a waiting run that nothing would move (no runner, no cron entry: submitted
    with --no-start and never scheduled).

    Example: xffl watch last
    """
    registry = Registry()
    record = resolve_run(registry, run)
    _something_to_follow(record)
    outcome(registry, follow(registry, record, timeout, as_json=as_json,
                             intro=f"following run [bold]{record.id}[/bold]"), as_json)
