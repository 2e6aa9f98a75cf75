"""`xffl resume`: continue a stopped run from its last completed round."""

from __future__ import annotations

from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg
from xffl.cli.watch import TimeoutOpt, follow, outcome
from xffl.jobs.registry.store import Registry


@handle_errors
def resume(
    run: RunArg,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends.")] = False,
    timeout: TimeoutOpt = 86400.0,
    as_json: JsonOpt = False,
) -> None:
    """Start a runner that continues RUN from the round after its last completed one.

    Works after any stop: the coordinator killed, a failed round (e.g. too few sites), a
    cancel. Finished rounds are never recomputed, and updates that already arrived for the
    interrupted round are reused; a site's SLURM job of that round still queued or running
    is adopted, not submitted again, and one that ended is continued from its checkpoint.
    With --wait it follows the run to its end, as
    `xffl submit --wait` does (exit 0 completed, 1 failed, 4 after --timeout).

    Example: xffl resume quickstart-20261122-051000-a3f9 --wait
    """
    from xffl.workflows.resume import resume_run

    registry = Registry()
    record = resolve_run(registry, run)
    pid = resume_run(registry, record)
    if wait:
        final = follow(registry, registry.get_run(record.id), timeout, as_json=as_json,
                       spawned=pid, intro=f"run {record.id} resumed from round "
                       f"{record.rounds_done + 1}; following it")
        outcome(registry, final, as_json)
        return
    if as_json:
        print_json({"run_id": record.id, "runner_pid": pid, "next_round": record.rounds_done + 1})
    else:
        console.print(f"run {record.id} resumed from round {record.rounds_done + 1} (runner pid "
                      f"{pid}); follow it with `xffl watch {record.id}`.", soft_wrap=True)
