"""`xffl schedule`: drive a run's rounds from cron, one round per tick."""

from __future__ import annotations

from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json, resolve_run
from xffl.cli.options import JsonOpt, RunArg
from xffl.core.errors import InvalidInput
from xffl.jobs.registry.store import Registry


@handle_errors
def schedule(
    run: RunArg,
    cron: Annotated[str | None, typer.Option(
        "--cron", help="Five-field cron expression, e.g. '*/30 * * * *'.")] = None,
    remove: Annotated[bool, typer.Option("--remove", help="Uninstall the entry.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Install a crontab entry that runs `xffl round RUN` (or remove it with --remove).

    Each tick runs the next round when the previous one is finished and does nothing while
    one is in flight; the tick that ends the run (its last round) removes the entry.
    Output goes to the run's cron.log. Submit with `--no-start` to leave every round to cron.

    Example: xffl schedule quickstart-20261122-051000-a3f9 --cron '*/30 * * * *'
    """
    from xffl.jobs import schedule as cron_table

    registry = Registry()
    record = resolve_run(registry, run)
    if remove == (cron is not None):
        raise InvalidInput("give either --cron EXPR or --remove.")
    if remove:
        removed = cron_table.remove(record.id)
        registry.event(record.id, "schedule", "cron entry removed" if removed
                       else "no cron entry to remove")
        if as_json:
            print_json({"run_id": record.id, "removed": removed})
        else:
            console.print(f"cron entry of {record.id} removed" if removed
                          else f"run {record.id} had no cron entry")
        return
    assert cron is not None
    entry = cron_table.install(record, cron)
    registry.event(record.id, "schedule", f"cron entry installed: {entry.expr}")
    tick = entry.next_tick()
    if as_json:
        print_json({"run_id": record.id, "cron": entry.expr, "command": entry.command,
                    "next_tick": tick.astimezone().isoformat(timespec="seconds")})
    else:
        console.print(f"run {record.id}: `xffl round` at '{entry.expr}' (next tick "
                      f"{tick:%Y-%m-%d %H:%M}); output in {record.run_dir}/cron.log",
                      soft_wrap=True)
