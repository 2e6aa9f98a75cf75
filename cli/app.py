"""The Typer application: global options and the list of commands."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, NoReturn

import typer
from typer._click.exceptions import UsageError  # Typer 0.28 vendors click

from xffl.cli import (
    aggregate,
    cancel,
    data,
    evaluate,
    export,
    init,
    logs,
    profiles,
    provenance,
    render,
    report,
    resume,
    round,
    runs,
    schedule,
    simulate,
    status,
    submit,
    validate,
    watch,
)
from xffl.cli.common import (
    XfflCommand,
    XfflSubGroup,
    console,
    err_console,
    error_json,
    no_env_help,
    show_usage_error,
    state,
)
from xffl.core.errors import ExitCode
from xffl.core.paths import private_files
from xffl.core.startup import collect_less


class XfflGroup(XfflSubGroup):
    """The root command group: ``--debug`` is taken anywhere before ``--``, as users type it;
    its own options (``--version``, ``--install-completion``, ...) never read the environment
    (``auto_envvar_prefix`` would make ``XFFL_VERSION=0.1.0`` fail every command and
    ``XFFL_INSTALL_COMPLETION=1`` edit ~/.bashrc); ``--debug`` reads ``XFFL_DEBUG`` only."""

    def get_params(self, ctx: Any) -> list[Any]:  # typer's vendored Context and Parameter
        """The root's parameters, none of them set from ``XFFL_<NAME>``."""
        params: list[Any] = super().get_params(ctx)
        return [no_env_help(p) for p in params]

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's vendored Context
        """Move every ``--debug`` that follows a subcommand in front of it."""
        end = args.index("--") if "--" in args else len(args)
        if "--debug" in args[:end]:
            args = ["--debug", *(a for a in args[:end] if a != "--debug"), *args[end:]]
        ctx.meta[_JSON_META] = "--json" in args[:end] or _env_true("XFFL_JSON")
        try:
            rest: list[str] = super().parse_args(ctx, args)
        except UsageError as exc:
            _usage_error(ctx, exc)
        return rest

    def invoke(self, ctx: Any) -> Any:  # typer's vendored Context
        """Run the command; a usage error (an unknown option, a bad value) under ``--json``
        is also the error object on stdout, as every other error is."""
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            _usage_error(ctx, exc)


def _usage_error(ctx: Any, exc: UsageError) -> NoReturn:
    """Report a usage error as xffl reports every error (``error: ...``; under ``--json`` the
    error object on stdout too) and exit 2; ``xffl`` alone still prints its help."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        raise exc
    if ctx.meta.get(_JSON_META):
        error_json(ExitCode.INVALID_INPUT, exc.format_message())
    show_usage_error(exc)
    raise typer.Exit(int(ExitCode.INVALID_INPUT))


_JSON_META = "xffl.json"


def _env_true(name: str) -> bool:
    """Whether ``name`` holds a true boolean as click reads one (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "t", "yes", "y", "on"}


app = typer.Typer(
    name="xffl",
    cls=XfflGroup,
    help="Cross-facility federated learning: train one model across HPC facilities whose "
    "data never leaves them.",
    no_args_is_help=True,
    # every command's option also reads XFFL_<COMMAND>_<OPTION> (XFFL_SUBMIT_TIMEOUT=600,
    # XFFL_STATUS_LIVE=0), --json XFFL_JSON and --debug XFFL_DEBUG; the command line wins.
    # The root's options and every --help read nothing (XfflGroup, XfflSubGroup)
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "XFFL"},
    pretty_exceptions_enable=False,
    # help: rich panels on a terminal (docstrings as Markdown paragraphs, so their line
    # breaks do not survive as ragged lines); plain click help, unpadded, into a pipe or file
    rich_markup_mode="markdown" if sys.stdout.isatty() else None,
)


def _version(value: bool) -> None:
    """Print xffl's version and leave (``--version``)."""
    if value:
        from importlib.metadata import version

        typer.echo(f"xffl {version('xffl')}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option(
        "--debug", envvar="XFFL_DEBUG",
        help="Show tracebacks on errors (anywhere on the command line).")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print xffl's version and exit.")] = False,
) -> None:
    """Cross-facility federated learning orchestrator."""
    state.debug = debug
    private_files()  # everything a command writes is owner-only
    for stream in (console, err_console):  # free text folds on a terminal, never in a pipe
        stream.soft_wrap = not stream.is_terminal


# the commands in the order `xffl --help` lists them; each module's function is the command
for command in (init.init, submit.submit, status.status, watch.watch, runs.runs, render.render,
                validate.validate, aggregate.aggregate, cancel.cancel, logs.logs, resume.resume,
                round.round_, schedule.schedule, report.report, provenance.provenance,
                export.export, evaluate.evaluate, simulate.simulate):
    app.command(name=command.__name__.rstrip("_"), cls=XfflCommand)(command)
# `xffl ls`: `xffl runs` under the name ls users type; hidden from the help, which lists runs
app.command(name="ls", cls=XfflCommand, hidden=True)(runs.runs)
app.add_typer(profiles.app, name="profiles")
# the name of xffl <= 0.1 for the same commands, kept for scripts; hidden from the help
app.add_typer(profiles.app, name="sites", hidden=True, deprecated=True)
app.add_typer(data.app, name="data")


def main() -> None:
    """Console-script entry point."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    app()
