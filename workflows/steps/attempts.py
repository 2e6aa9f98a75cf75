"""What the failure manager makes of a site's failed or continued job: the reason in one line,
the checkpoint progress and a chained round's continuation read from the trainer's own lines
(bounded numbers, never a path), and whether the attempt uses up a retry. The record it keeps
is :mod:`xffl.jobs.registry.attempts`."""

from __future__ import annotations

import re

from xffl.jobs.registry.attempts import SiteAttempts

REASON_CHARS = 400
#: the line a site's rank 0 prints when a checkpoint inside the round is complete
#: (xffl.training.round_state.PROGRESS_LINE): a bounded number, never a path
_PROGRESS_RE = re.compile(r"\bxffl\.training: checkpoint complete: round ([0-9]{1,9}) "
                          r"step ([0-9]{1,9})\b")
#: the line a site's rank 0 prints when its job ends a chained round early to continue it in
#: the next job (xffl.training.chain_files.CONTINUE_LINE, with the seconds a step took):
#: numbers only
_CONTINUE_RE = re.compile(r"\bxffl\.training: round ([0-9]{1,9}) continues in the next job at "
                          r"step ([0-9]{1,9}) of ([0-9]{1,9})(?: \(([0-9]{1,9}(?:\.[0-9]{1,6})?)"
                          r" s/step\))?")
#: retries that progressed past the site's last checkpoint and so consume no retry, at most
#: (a site reporting ever higher steps cannot make a round retry it forever)
FREE_RETRIES = 100


def short_reason(text: str) -> str:
    """One line out of a failure message: the trainer's own sentence when there is one.

    StreamFlow reports a failed command as ``FAILED Job NAME with error:`` followed by the
    command's output; the useful sentence is the trainer's (``xffl.training (rank 0): ...``),
    else the last line xffl printed, else the last line.
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "no reason given"
    if lines[0].startswith("FAILED Job") and len(lines) > 1:
        body = lines[1:]
        pick = next((ln for ln in body if ln.startswith("xffl.training (rank")),
                    next((ln for ln in reversed(body) if ln.startswith("xffl")), body[-1]))
        return pick[:REASON_CHARS]
    return " ".join(lines[:2])[:REASON_CHARS]


def progress_step(text: str, rnd: int) -> int | None:
    """The highest checkpoint step of round ``rnd`` a failed attempt's output reports as
    complete (None: none). Only the trainer's own line counts, and only its numbers."""
    steps = [int(m.group(2)) for m in _PROGRESS_RE.finditer(text) if int(m.group(1)) == rnd]
    return max(steps) if steps else None


def counts_against_retries(record: SiteAttempts, text: str) -> bool:
    """Whether the failed attempt whose output is ``text`` uses up a retry: not when it left
    a checkpoint of a later step than any attempt before (the next attempt continues from
    it), up to :data:`FREE_RETRIES` times. Updates ``record``."""
    step = progress_step(text, record.round)
    if step is None or step <= record.best_step or record.progressed >= FREE_RETRIES:
        return True
    record.best_step = step
    record.progressed += 1
    return False


def continues(record: SiteAttempts, text: str) -> bool:
    """Whether the attempt whose output is ``text`` ended a chained round's job to continue
    the round in the next (its rank 0's line, of this round, at a step past any before and
    short of the round's end), at most :data:`FREE_RETRIES` times a round. Updates
    ``record``."""
    found = [m for m in _CONTINUE_RE.finditer(text) if int(m.group(1)) == record.round]
    if not found or record.continued >= FREE_RETRIES:
        return False
    match = found[-1]
    step, steps = int(match.group(2)), int(match.group(3))
    if step <= record.best_step or step >= steps:
        return False
    record.best_step, record.steps = step, steps
    record.step_seconds = float(match.group(4) or 0.0)
    record.continued += 1
    return True


