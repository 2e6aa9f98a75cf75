"""`xffl submit`: start a federated run from a job spec, optionally following it to the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from xffl.cli.common import JsonOpt, console, handle_errors, print_json
from xffl.core.errors import ExitCode
from xffl.jobs.registry import Registry, RunRecord
from xffl.jobs.states import RunState


@handle_errors
def submit(
    job: Annotated[Path, typer.Argument(help="The job spec (YAML).")],
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends.")] = False,
    name: Annotated[
        str | None, typer.Option(help="Prefix of the run id (default: the job name).")
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="With --wait: stop following after this many seconds.")
    ] = 86400.0,
    start: Annotated[bool, typer.Option(
        help="Start the runner now; --no-start leaves the run to `xffl round` (cron).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Validate JOB, register a run, start its runner in the background; print the run id.

    Example: xffl submit jobs/quickstart.yaml --wait
    """
    from xffl.jobs.follow import wait_for_run
    from xffl.workflows.submit import submit as submit_job

    submitted = submit_job(job, name=name, start=start)
    run = submitted.run
    registry = Registry()
    if not wait or not start:
        if as_json:
            print_json({"run": run.id, "run_dir": run.run_dir, "state": run.state})
        else:
            console.print(f"submitted run [bold]{run.id}[/bold]; " + (
                f"runner pid {submitted.pid}; follow it with `xffl status {run.id}`."
                if submitted.pid else run.message))
        return
    if as_json:
        final = wait_for_run(registry, run.id, timeout, spawned=submitted.pid)
    else:
        console.print(f"submitted run [bold]{run.id}[/bold]; following it (Ctrl-C stops "
                      "following, not the run)")
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} rounds"), TimeElapsedColumn(),
                      console=console, transient=False) as progress:
            task = progress.add_task(run.state, total=run.rounds_total)

            def update(r: RunRecord) -> None:
                label = r.state if r.finished else f"{r.state}: round {r.rounds_done + 1}"
                progress.update(task, completed=r.rounds_done, description=label)

            final = wait_for_run(registry, run.id, timeout, on_update=update,
                                 spawned=submitted.pid)
    from xffl.jobs.status import latest_global, run_status

    model = latest_global(registry, final)
    if as_json:
        print_json(run_status(registry, final, slurm=True, live=False).as_json())
    elif final.state == RunState.COMPLETED:
        console.print(f"[green]run {final.id} completed[/green]: {final.rounds_done} rounds.")
        console.print(f"final global model: {model}")
        console.print(f"next: `xffl status {final.id}` shows every round and site.")
    else:
        console.print(f"[red]run {final.id} {final.state}[/red]: {final.message}")
        console.print(f"next: `xffl status {final.id}`, and the logs in {final.run_dir}.")
    if final.state != RunState.COMPLETED:
        raise typer.Exit(int(ExitCode.RUN_FAILED))
