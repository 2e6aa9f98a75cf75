"""`xffl cancel`: stop a run, its runner and its jobs at every SLURM site."""

from __future__ import annotations

from dataclasses import asdict

import typer

from xffl.cli.common import (
    console,
    err_console,
    handle_errors,
    markup_safe,
    print_json,
    resolve_run,
)
from xffl.cli.options import JsonOpt, RunArg
from xffl.core.errors import ExitCode
from xffl.jobs.registry.store import Registry


@handle_errors
def cancel(
    run: RunArg,
    as_json: JsonOpt = False,
) -> None:
    """Cancel a run: remove its cron entry and mark it cancelled, stop its runner, scancel
    its job at every SLURM site and check with squeue (up to 10 s) that none is left.

    The run's round lock is held from the runner's stop to the last record, so no cron tick
    starts a round meanwhile. What a site prints that is not SLURM's is a warning.

    A run that already finished is left as it is (exit 0). When a site cannot be reached the
    run is still marked cancelled here (its runner is stopped) and the command exits 3: the
    message names the job to scancel at that site by hand.

    Example: xffl cancel quickstart-20261122-051000-a3f9
    """
    from xffl.jobs.cancel import cancel_run

    registry = Registry()
    record = resolve_run(registry, run)
    result = cancel_run(registry, record)
    final = registry.get_run(record.id)
    if as_json:
        print_json({**asdict(result), "message": final.message})
    elif result.already_finished:
        console.print(f"run {record.id} already {result.state}: nothing to cancel")
    else:
        console.print(f"run {record.id} cancelled"
                      + (f" (SLURM jobs cancelled at {', '.join(result.cancelled_sites)})"
                         if result.cancelled_sites else ""))
        for warning in result.warnings:
            err_console.print(f"[yellow]warning:[/yellow] {markup_safe(warning)}",
                              soft_wrap=True)
        for site, why in sorted(result.unreachable.items()):
            err_console.print(f"[red]error:[/red] site {site} unreachable: {markup_safe(why)}; "
                              f"{markup_safe(final.message)}", soft_wrap=True)
    if result.unreachable:
        raise typer.Exit(int(ExitCode.CONNECTION))
