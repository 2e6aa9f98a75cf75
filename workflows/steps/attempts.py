"""A site's failed attempts in one round, as the failure manager records them for the admit step.

The failure manager runs inside StreamFlow on the coordinator; it writes
``rounds/<r>/attempts/<site>.json`` every time one of the site's steps fails, and the admit
step of that site and round reads it (of the final model's evaluation after the last round:
``final-attempts/<site>.json``, read by the final validation step): how many times the job
ran, why each attempt failed, and whether the site was given up (the round then goes on
without it). The file is written by the coordinator, never by a site, and atomically.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xffl.core.files import write_json
from xffl.core.layout import RunLayout

REASON_CHARS = 400
#: the line a site's rank 0 prints when a checkpoint inside the round is complete
#: (xffl.training.round_state.PROGRESS_LINE): a bounded number, never a path
_PROGRESS_RE = re.compile(r"\bxffl\.training: checkpoint complete: round ([0-9]{1,9}) "
                          r"step ([0-9]{1,9})\b")
#: the line a site's rank 0 prints when its job ends a chained round early to continue it in
#: the next job (xffl.training.chain.CONTINUE_LINE, with the seconds a step took): numbers only
_CONTINUE_RE = re.compile(r"\bxffl\.training: round ([0-9]{1,9}) continues in the next job at "
                          r"step ([0-9]{1,9}) of ([0-9]{1,9})(?: \(([0-9]{1,9}(?:\.[0-9]{1,6})?)"
                          r" s/step\))?")
#: retries that progressed past the site's last checkpoint and so consume no retry, at most
#: (a site reporting ever higher steps cannot make a round retry it forever)
FREE_RETRIES = 100


@dataclass
class SiteAttempts:
    """What went wrong for one site in one round."""

    site: str
    round: int
    attempts: int = 1
    failures: list[str] = field(default_factory=list)  # "attempt N: reason", in order
    gave_up: bool = False
    timed_out: bool = False
    final: bool = False  # the final model's evaluation after the last round, not a round's job
    # failed attempts that left a newer complete checkpoint (training.checkpoint): they do
    # not count against failure.retries; best_step: the highest checkpoint step reported
    progressed: int = 0
    best_step: int = 0
    # jobs that ended a chained round early to continue it (training.checkpoint.chain): no
    # failure, no retry; steps: the round's steps, step_seconds: the last job's per step
    continued: int = 0
    steps: int = 0
    step_seconds: float = 0.0

    @property
    def reason(self) -> str:
        """Every failed attempt's reason, in one line."""
        return "; ".join(self.failures)


def read_attempts(layout: RunLayout, rnd: int, site: str,
                  final: bool = False) -> SiteAttempts | None:
    """The record of ``site`` in round ``rnd`` (``final``: in the final model's evaluation);
    None when no step of it failed."""
    path = layout.final_attempts_file(site) if final else layout.attempts_file(rnd, site)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return SiteAttempts(site=site, round=rnd, attempts=int(data["attempts"]),
                        failures=[str(f) for f in data["failures"]],
                        gave_up=bool(data["gave_up"]), timed_out=bool(data["timed_out"]),
                        final=final, progressed=int(data.get("progressed", 0)),
                        best_step=int(data.get("best_step", 0)),
                        continued=int(data.get("continued", 0)),
                        steps=int(data.get("steps", 0)),
                        step_seconds=float(data.get("step_seconds", 0.0)))


def write_attempts(layout: RunLayout, record: SiteAttempts) -> Path:
    """Store ``record`` (atomically); return its file."""
    path = (layout.final_attempts_file(record.site) if record.final
            else layout.attempts_file(record.round, record.site))
    data = asdict(record)
    del data["final"]  # the file's place says it
    write_json(path, data)
    return path


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


def eta_seconds(record: SiteAttempts) -> float | None:
    """Seconds of training a chained round still needs (its steps left at the last job's
    seconds per step; None when unknown). Queue waits of the jobs to come are not in it."""
    if record.steps <= record.best_step or record.step_seconds <= 0:
        return None
    return (record.steps - record.best_step) * record.step_seconds
