"""The Typer application: global options and the list of commands."""

from __future__ import annotations

from typing import Annotated

import typer

from xffl.cli import (
    aggregate,
    cancel,
    data,
    logs,
    provenance,
    render,
    report,
    resume,
    round,
    runs,
    schedule,
    simulate,
    sites,
    status,
    submit,
    validate,
)
from xffl.cli.common import state
from xffl.core.paths import private_files

app = typer.Typer(
    name="xffl",
    help="Cross-facility federated learning: train one model across HPC facilities whose "
    "data never leaves them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """Cross-facility federated learning orchestrator."""
    state.debug = debug
    private_files()  # everything a command writes is owner-only


app.command()(submit.submit)
app.command()(status.status)
app.command()(runs.runs)
app.command()(render.render)
app.command()(validate.validate)
app.command()(aggregate.aggregate)
app.command()(cancel.cancel)
app.command()(logs.logs)
app.command()(resume.resume)
app.command(name="round")(round.round_)
app.command()(schedule.schedule)
app.command()(report.report)
app.command()(provenance.provenance)
app.command()(simulate.simulate)
app.add_typer(sites.app, name="sites")
app.add_typer(data.app, name="data")


def main() -> None:
    """Console-script entry point."""
    app()
