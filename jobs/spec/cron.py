"""Cron expressions for rounds driven by cron (`xffl schedule RUN --cron EXPR`), checked early."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from croniter import CroniterError, croniter

from xffl.core.errors import InvalidInput

EXAMPLE = "*/30 * * * *"
ALIASES = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight",
                     "@hourly"})
FIELDS = (("minute", "0-59"), ("hour", "0-23"), ("day-of-month", "1-31"),
          ("month", "1-12 or jan-dec"), ("day-of-week", "0-7 or sun-sat"))
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _fail(expr: str, why: str) -> InvalidInput:
    """The one-line error for a bad expression."""
    return InvalidInput(f"cron expression {expr!r}: {why}; use five fields like {EXAMPLE!r}.")


def validate_cron(expr: str) -> str:
    """The expression with single spaces if it is a five-field cron line (or an @alias).

    Raises InvalidInput naming the expression and why it is refused: a wrong number of
    fields, a value out of range or not understood, or a schedule that never fires.
    """
    if not isinstance(expr, str) or not expr.strip():
        raise _fail(str(expr), "is empty")
    if _CONTROL.search(expr):
        raise _fail(expr, "holds a control character (newline, tab, ...)")
    fields = expr.split()
    if len(fields) == 1 and fields[0].startswith("@"):
        if fields[0].lower() not in ALIASES:
            raise _fail(expr, f"unknown alias {fields[0]!r} (known: {', '.join(sorted(ALIASES))})")
        return fields[0].lower()
    if len(fields) != 5:
        raise _fail(expr, f"has {len(fields)} field{'s' if len(fields) != 1 else ''}, not 5 "
                          "(minute hour day-of-month month day-of-week)")
    for i, (name, allowed) in enumerate(FIELDS):
        alone = ["*"] * 5
        alone[i] = fields[i]
        if not _fires(" ".join(alone)):
            raise _fail(expr, f"the {name} field {fields[i]!r} is not valid (allowed: {allowed})")
    normal = " ".join(fields)
    if not _fires(normal):
        raise _fail(expr, "never fires (no such date)")
    return normal


def _fires(expr: str) -> bool:
    """Whether croniter parses ``expr`` and finds a next time for it."""
    try:
        croniter(expr, datetime(2000, 1, 1, tzinfo=timezone.utc)).get_next(datetime)
    except (CroniterError, ValueError, KeyError, IndexError):
        return False
    return True
