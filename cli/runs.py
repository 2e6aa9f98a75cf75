"""`xffl runs`: a table of every run in the registry."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from xffl.cli.common import console, handle_errors, print_json
from xffl.cli.options import JsonOpt
from xffl.cli.tables import Rows
from xffl.jobs.registry.store import Registry


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


@handle_errors
def runs(
    as_json: JsonOpt = False,
    tsv: Annotated[bool, typer.Option("--tsv", help="Print the rows alone, tab-separated, "
                                      "without the header line.")] = False,
) -> None:
    """List the runs, newest first (an 80-column terminal shows run, state, rounds and
    message; --json or --tsv every field). `xffl ls` is the same command.

    Example: xffl runs --json
    """
    from xffl.jobs.status import run_summary, settle

    registry = Registry()
    records = [settle(registry, r) for r in registry.list_runs()]
    if as_json:
        print_json([run_summary(r) for r in records])
        return
    if not records:
        if tsv:
            return
        console.print("no runs yet; try `xffl init demo && xffl submit demo/job.yaml --wait`.",
                      soft_wrap=True)
        return
    table = Rows(("run", "state", "rounds", "sites", "created", "message"),
                 text=("sites", "message"), compact=("run", "state", "rounds", "message"))
    for r in records:
        table.add(r.id, r.state, f"{r.rounds_done}/{r.rounds_total}", ", ".join(r.sites),
                      _when(r.created), r.message)
    table.print(tsv)
