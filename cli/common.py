"""What every command shares: consoles, the --debug state, error handling and JSON output."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from xffl.core.errors import ExitCode, XfflError
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry


class _Console(Console):
    """A rich Console for which a reader that stopped early (``xffl status | head``) is fine."""

    def on_broken_pipe(self) -> None:
        """Stop writing and exit 0 (rich's default exits 1, as if the command had failed)."""
        self.quiet = True
        quiet_stdout()
        raise SystemExit(int(ExitCode.OK))


console = _Console(highlight=False)
err_console = _Console(stderr=True, highlight=False)

def no_env_help(option: Any) -> Any:
    """``option`` (a command's ``--help``) made deaf to ``auto_envvar_prefix``: no
    ``XFFL_RUNS_HELP=1`` in the environment turns every ``xffl runs`` into its help."""
    if option is not None:
        option.allow_from_autoenv = False
    return option


_DECLARED_HELP = "_xffl_declared_help"  # an option's help before fill_help, kept on it


class XfflCommand(TyperCommand):
    """A command whose usage line reads as click and man pages write it: ``JOB``, not
    Typer 0.28's ``{JOB}`` (braces read as a choice); optional ones stay ``[RUN]``."""

    def get_help_option(self, ctx: Any) -> Any:  # typer's vendored Context and Option
        """``--help``, never set from the environment."""
        return no_env_help(super().get_help_option(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:  # typer's vendored Context
        """The usage line's pieces, required arguments without braces."""
        pieces: list[str] = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]

    def get_params(self, ctx: Any) -> list[Any]:  # typer's vendored Context and Parameter
        """The parameters; an option whose type can name its choices (``fill_help``) has them
        in its help, as they are when the help is drawn (a plugin's included): filled from the
        declared help each time, so a command drawn twice in one process shows them anew."""
        params: list[Any] = super().get_params(ctx)
        for param in params:
            fill = getattr(param.type, "fill_help", None)
            if callable(fill) and getattr(param, "help", None):
                declared = param.__dict__.setdefault(_DECLARED_HELP, param.help)
                param.help = fill(declared)
        return params


class XfflSubGroup(TyperGroup):
    """A command group under ``xffl`` (``profiles``, ``data``): its ``--help`` is never set
    from the environment."""

    def get_help_option(self, ctx: Any) -> Any:  # typer's vendored Context and Option
        """``--help``, never set from the environment."""
        return no_env_help(super().get_help_option(ctx))


class _State:
    debug = False


state = _State()

P = ParamSpec("P")
R = TypeVar("R")


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn XfflError into one line on stderr and its exit code; no traceback unless --debug.

    Under ``--json`` stdout also gets the error as JSON, ``{"error": {"code", "kind",
    "message", "lines"}}``, so that a script reading stdout always reads JSON.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        as_json = bool(kwargs.get("as_json") or kwargs.get("json_out"))
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except BrokenPipeError:  # the reader stopped early (`| head`): what it read was right
            quiet_stdout()
            raise typer.Exit(int(ExitCode.OK)) from None
        except XfflError as exc:
            if state.debug:
                traceback.print_exc()
            for line in exc.lines:
                err_console.print(error_text(line), soft_wrap=True)
            if as_json:
                error_json(exc.exit_code, exc.message, exc.lines)
            raise typer.Exit(int(exc.exit_code)) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            if as_json:
                error_json(ExitCode.INTERRUPTED, "interrupted")
            raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
        except Exception as exc:
            if state.debug:
                traceback.print_exc()
            message = (f"internal error: {type(exc).__name__}: {exc} (run again with --debug "
                       "for the traceback, and please report it)")
            err_console.print(
                Text.assemble(("internal error:", "red"), message.removeprefix("internal error:")),
                soft_wrap=True,
            )
            if as_json:
                error_json(ExitCode.INTERNAL, message)
            raise typer.Exit(int(ExitCode.INTERNAL)) from None

    return wrapper


def error_json(code: ExitCode, message: str, lines: list[str] | None = None) -> None:
    """The error envelope on stdout, for a command run with ``--json``."""
    print_json({"error": {"code": int(code), "kind": code.name.lower(), "message": message,
                          "lines": lines or [message]}})


def quiet_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and the flush at exit must not fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def show_usage_error(exc: Any) -> None:
    """A usage error (typer's vendored click UsageError) as every other error reads: its usage
    line and help hint, then ``error: MESSAGE`` (click's own says ``Error:``)."""
    ctx = exc.ctx
    if ctx is not None:
        err_console.print(ctx.get_usage(), markup=False, highlight=False, soft_wrap=True)
        if ctx.command.get_help_option(ctx) is not None:
            err_console.print(f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help.",
                              markup=False, highlight=False, soft_wrap=True)
        err_console.print()
    err_console.print(error_text(exc.format_message()), soft_wrap=True)


def error_text(line: str) -> Text:
    """``error: LINE`` as plain text: user values never read as rich markup, one line always."""
    flat = line.replace("\r", "\\r").replace("\n", "\\n")
    return Text.assemble(("error:", "red"), " ", printable(flat))


# what a terminal would act on rather than show: C0 and C1 controls (ESC, BEL, CR, ...) but
# tab and newline, DEL, and the bidirectional overrides that reorder what is shown
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(value: object) -> str:
    """Text from outside xffl (a facility's words in the registry, a log line) as a terminal
    may show it: every control, escape or bidi character written out (``\\x1b``)."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode(), str(value))


def markup_safe(value: object) -> str:
    """:func:`printable` text with rich markup escaped: safe inside a markup string."""
    return escape(printable(value))


def print_json(data: Any) -> None:
    """Write ``data`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def resolve_run(registry: Registry, ref: str) -> RunRecord:
    """The run named by ``ref``: a full id, an unambiguous prefix, or 'last'."""
    from xffl.core.errors import InvalidInput

    if ref == "last":
        runs = registry.list_runs()
        if not runs:
            raise InvalidInput("there are no runs yet; submit one with `xffl submit JOB.yaml`.")
        return runs[0]
    matches = registry.find_runs(ref)
    exact = [r for r in matches if r.id == ref]
    if exact:
        return exact[0]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise InvalidInput(f"no run {ref!r}; `xffl runs` lists the runs.")
    raise InvalidInput(
        f"{ref!r} matches {len(matches)} runs ({', '.join(r.id for r in matches[:3])}, ...); "
        "give more of the id."
    )
