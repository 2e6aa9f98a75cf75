"""Error types that carry the CLI exit code and one user-facing sentence."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of every xffl command (the CLI contract in the README)."""

    OK = 0
    RUN_FAILED = 1
    INVALID_INPUT = 2
    CONNECTION = 3
    TIMEOUT = 4
    INTERNAL = 5
    CONTINUED = 75  # a site job ended a chained round early after a checkpoint (EX_TEMPFAIL)
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class XfflError(Exception):
    """An error whose message is meant for the user, with the exit code to leave with."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, lines: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.lines = lines or [message]


class InvalidInput(XfflError):
    """Bad job spec, profile, option or file: exit 2."""

    exit_code = ExitCode.INVALID_INPUT


class RunFailed(XfflError):
    """A run or job failed: exit 1."""

    exit_code = ExitCode.RUN_FAILED


class ConnectionFailed(XfflError):
    """A site could not be reached or refused authentication: exit 3."""

    exit_code = ExitCode.CONNECTION


class TimedOut(XfflError):
    """A bounded wait ran out: exit 4."""

    exit_code = ExitCode.TIMEOUT


class CheckpointError(XfflError):
    """A checkpoint failed verification (checksum, manifest, tensors)."""

    exit_code = ExitCode.RUN_FAILED


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (its type name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
