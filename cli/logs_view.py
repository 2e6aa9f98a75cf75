"""What `xffl logs` shows first and leaves out: a failed run's cause, per site, from the
registry (what `xffl status` shows), and the logs without the tracebacks of StreamFlow's and
the supervisor's internals (``--debug`` shows every line)."""

from __future__ import annotations

import re

from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry

# a logging record's first line: its time stamp (the lines that follow it, a traceback's
# among them, are its continuation)
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:,\d+)?\s+")
_TRACEBACK = ("Traceback (most recent call last):", "Exception Group Traceback")
# the sentences Python writes between the tracebacks of a chained exception
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")
# an exception's line: `sqlite3.ProgrammingError: ...`, `KeyboardInterrupt`
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Group|Interrupt|Exit|Warning)\b.*$")
HIDDEN = "(traceback hidden: --debug shows it)"


def causes(registry: Registry, run: RunRecord, site: str | None = None) -> list[str]:
    """Why a failed or cancelled run ended, as the registry recorded it: the run's message,
    then each site (or only ``site``) that failed a round, with its attempts and its reason;
    none otherwise."""
    if run.state not in (RunState.FAILED, RunState.CANCELLED):
        return []
    lines = [f"run {run.id} {run.state}: {run.message}" if run.message
             else f"run {run.id} {run.state}"]
    for rnd in registry.rounds(run.id):
        for row in rnd.sites:
            if row.state != "failed" or site not in (None, row.site):
                continue
            tries = f" after {row.attempts} attempts" if row.attempts > 1 else ""
            lines.append(f"round {rnd.round}, site {row.site}: failed{tries}"
                         + (f": {row.reason}" if row.reason else ""))
    return lines


def _starts_traceback(line: str) -> bool:
    """Whether ``line`` opens a traceback (an exception group's is drawn ``  + Exception
    Group Traceback ...``)."""
    return line.strip(" \t+|").startswith(_TRACEBACK)


def _traceback_end(lines: list[str], i: int) -> int:
    """The index after the traceback that starts at ``lines[i]``: its indented frames, its
    exception's line, and any exception chained to it (a blank line, Python's sentence, the
    next traceback)."""
    while True:
        group = lines[i][:1] in (" ", "\t")  # an exception group's: indented, end included
        i += 1
        while i < len(lines) and (lines[i][:1] in (" ", "\t") or not lines[i].strip()):
            i += 1
        if group:
            return i
        i += 1  # the exception's own line: `sqlite3.ProgrammingError: ...`, and its message's
        while i < len(lines) and lines[i][:1] in (" ", "\t"):  # next lines, indented
            i += 1
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j < len(lines) and lines[j].strip() in _CHAINED:
            j += 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and _starts_traceback(lines[j]):
                i = j
                continue
        return min(i, len(lines))


def without_tracebacks(lines: list[str]) -> list[str]:
    """``lines`` with each traceback replaced by a note on the last line of the logging
    record it belongs to (a line of its own, naming its exception, where no record precedes
    it: a ``print``'s traceback), and a record repeated at once (the same words at a later
    time) said once, with how many times."""
    out: list[str] = []
    in_record = False
    i = 0
    while i < len(lines):
        if not _starts_traceback(lines[i]):
            in_record = in_record or bool(_STAMP.match(lines[i]))
            out.append(lines[i])
            i += 1
            continue
        if in_record:  # a record's traceback runs to the next record (its exception's
            # message may go on over lines of its own, indented or not)
            end = next((j for j in range(i + 1, len(lines)) if _STAMP.match(lines[j])),
                       len(lines))
        else:
            end = _traceback_end(lines, i)
        if in_record and out:
            out[-1] += f" {HIDDEN}"
        else:
            raised = _exception(lines[i:end])
            out.append(f"{raised} {HIDDEN}" if raised else HIDDEN)
        i = end
    return _said_once(out)


def _exception(block: list[str]) -> str:
    """The line of a traceback that names what was raised: an exception group's own, else
    the last exception's (a chained one's cause comes first)."""
    named = [m[0] for line in block if (m := _RAISED.match(line.strip(" \t+|")))]
    groups = [line for line in named if line.split(":")[0].endswith("Group")]
    return (groups or named or [""])[0 if groups else -1]


def _said_once(lines: list[str]) -> list[str]:
    """Runs of one record at different times as its first line and a count."""
    out: list[str] = []
    repeats = 0
    for line in [*lines, None]:
        if line is not None and out and _STAMP.match(line) \
                and _STAMP.sub("", line) == _STAMP.sub("", out[-1]):
            repeats += 1
            continue
        if repeats:
            out.append(f"  (the line above {repeats} more time{'s' * (repeats > 1)})")
            repeats = 0
        if line is not None:
            out.append(line)
    return out
