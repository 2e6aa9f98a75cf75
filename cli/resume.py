"""`xffl resume`: continue a stopped run from its last completed round."""

from __future__ import annotations

from xffl.cli.common import JsonOpt, RunArg, console, handle_errors, print_json, resolve_run
from xffl.jobs.registry import Registry


@handle_errors
def resume(
    run: RunArg,
    as_json: JsonOpt = False,
) -> None:
    """Start a runner that continues RUN from the round after its last completed one.

    Works after any stop: the coordinator killed, a failed round (e.g. too few sites), a
    cancel. Finished rounds are never recomputed, and updates that already arrived for the
    interrupted round are reused.

    Example: xffl resume quickstart-20261122-051000-a3f9
    """
    from xffl.workflows.resume import resume_run

    registry = Registry()
    record = resolve_run(registry, run)
    pid = resume_run(registry, record)
    if as_json:
        print_json({"run_id": record.id, "runner_pid": pid, "next_round": record.rounds_done + 1})
    else:
        console.print(f"run {record.id} resumed from round {record.rounds_done + 1} (runner pid "
                      f"{pid}); follow it with `xffl status {record.id}`.")
