"""A site's attempts in one round, as the coordinator's failure manager records them in the run
folder (``rounds/<r>/attempts/<site>.json``; of the final model's evaluation after the last
round, ``final-attempts/<site>.json``): how many times the job ran, why each attempt failed,
whether the site was given up, and a chained round's continued jobs. Written by the
coordinator, never by a site, and atomically; read by the admit and final validation steps and
by ``xffl status``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xffl.core.files import write_json
from xffl.core.layout import RunLayout


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


def eta_seconds(record: SiteAttempts) -> float | None:
    """Seconds of training a chained round still needs (its steps left at the last job's
    seconds per step; None when unknown). Queue waits of the jobs to come are not in it."""
    if record.steps <= record.best_step or record.step_seconds <= 0:
        return None
    return (record.steps - record.best_step) * record.step_seconds
