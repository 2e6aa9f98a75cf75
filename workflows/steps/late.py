"""Late SLURM jobs (``round_deadline.late: adopt``): left running at a deadline, adopted later.

At a round's deadline the ``xffl-slurm`` connector leaves a site's job alone and writes
``late/<site>.json`` (:class:`LateJob`: the SLURM job id, the round it was submitted in and
its job folder at the site). The admit step of that round records the site ``late``. The
next round's train step for the site adopts the job instead of submitting one: it polls it
by id, and when it ends moves its ``update/`` into the step's own folder and writes
``rounds/<r>/adopted/<site>.json``; the admit step then checks the update against the global
it started from (round ``started - 1``) and the aggregate step applies it with its staleness
weight (:mod:`xffl.aggregator.rebase`). Every file here is written by the coordinator,
never by a site, and atomically.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xffl.core.files import write_json
from xffl.core.layout import RunLayout

_JOB_ID = re.compile(r"[0-9]{1,20}")


@dataclass(frozen=True)
class LateJob:
    """A site's SLURM job still queued or running when its round's deadline passed."""

    site: str
    job_id: str
    round: int  # the round it was submitted in: it trains from the global of round - 1
    workdir: str  # its job folder at the site, where it writes update/
    left_at: float = field(default_factory=time.time)

    def staleness(self, rnd: int) -> int:
        """Rounds late when its update is taken in round ``rnd``."""
        return rnd - self.round


def _read(path: Path) -> LateJob | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    job = LateJob(site=str(data["site"]), job_id=str(data["job_id"]), round=int(data["round"]),
                  workdir=str(data["workdir"]), left_at=float(data["left_at"]))
    if not is_job_id(job.job_id):
        raise ValueError(f"{path}: {job.job_id!r} is not a SLURM job id")
    return job


def read_late(layout: RunLayout, site: str) -> LateJob | None:
    """``site``'s job left running at a deadline and not adopted yet (None: none)."""
    return _read(layout.late_job(site))


def is_job_id(text: str) -> bool:
    """Whether ``text`` (what the facility's sbatch answered) is a plain SLURM job id."""
    return _JOB_ID.fullmatch(text) is not None


def leave_late(layout: RunLayout, job: LateJob) -> Path:
    """Record ``job`` as left running at its round's deadline (ValueError: its id is not a
    plain SLURM job id, which a later round would pass to squeue and scancel)."""
    if not is_job_id(job.job_id):
        raise ValueError(f"{job.job_id!r} is not a SLURM job id")
    path = layout.late_job(job.site)
    write_json(path, asdict(job))
    return path


def mark_adopted(layout: RunLayout, rnd: int, job: LateJob) -> Path:
    """Record that round ``rnd`` took ``job``'s update; it is no longer late."""
    path = layout.adopted_job(rnd, job.site)
    write_json(path, asdict(job))
    layout.late_job(job.site).unlink(missing_ok=True)
    return path


def read_adopted(layout: RunLayout, rnd: int, site: str) -> LateJob | None:
    """The late job whose update round ``rnd`` took from ``site`` (None: its own job's)."""
    return _read(layout.adopted_job(rnd, site))


def forget_adopted(layout: RunLayout, rnd: int, site: str) -> None:
    """Round ``rnd`` submits its own job at ``site`` (it runs again): no adopted update."""
    with contextlib.suppress(FileNotFoundError):
        layout.adopted_job(rnd, site).unlink()
