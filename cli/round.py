"""`xffl round`: run the next round of a run, once (what a cron tick runs)."""

from __future__ import annotations

import contextlib
import sys

import typer

from xffl.cli.common import console, handle_errors, markup_safe, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg
from xffl.core.errors import ExitCode
from xffl.jobs.registry.store import Registry


@handle_errors
def round_(
    run: RunArg,
    as_json: JsonOpt = False,
) -> None:
    """Run the next round of RUN in this process, then return.

    Does nothing (exit 0, logged in the run's events) while another round of the run is in
    flight: the run's round lock decides, not a guess. After the last round the run is
    completed; a completed, cancelled or failed run is left as it is (resume a failed one
    with `xffl resume`).

    Example: xffl round quickstart-20261122-051000-a3f9
    """
    from xffl.workflows.supervisor import execute

    registry = Registry()
    record = resolve_run(registry, run)
    if record.state.terminal:
        message = f"run {record.id} is {record.state}: no round to run"
        code = 0
    else:  # the state is checked again under the round lock (a cancel may come first)
        # what the round prints goes to the log (cron.log); with --json, stdout is the JSON
        with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
            code = execute(record.id, registry, once=True)
        final = registry.get_run(record.id)
        message = f"run {record.id}: {final.state}: {final.message}"
    final = registry.get_run(record.id)
    if final.state.terminal and _unschedule(registry, final.id):
        message += "; its cron entry is removed (no round is left to run)"
    if as_json:
        print_json({"run_id": final.id, "state": final.state, "rounds_done": final.rounds_done,
                    "message": final.message})
    else:
        console.print(markup_safe(message), soft_wrap=True)
    if code:
        raise typer.Exit(int(ExitCode.RUN_FAILED))


def _unschedule(registry: Registry, run_id: str) -> bool:
    """Remove the cron entry of a run that ended (whether there was one); a crontab that
    cannot be edited is a warning in the run's events, never a failed tick."""
    from xffl.core.errors import XfflError
    from xffl.jobs import schedule as cron_table

    try:
        if cron_table.current(run_id) is None or not cron_table.remove(run_id):
            return False
    except (OSError, XfflError) as exc:
        registry.event(run_id, "schedule", f"cron entry not removed: {exc}")
        return False
    registry.event(run_id, "schedule", "cron entry removed: the run ended")
    return True
