"""A site's SLURM job in flight, recorded at submission: a later supervisor finds it again.

When the ``xffl-slurm`` connector submits a site's train job, it writes
``rounds/<r>/inflight/<site>.json`` (:class:`InflightJob`: the job id sbatch answered, checked
as digits; the job's folder at the site, which is the coordinator's own path for it; the
submit time and the submitting process), owner-only and atomically, and removes it when the
step has the job's outcome (it ended, was scancelled at its deadline or left late). A
cancelled step (``xffl cancel``: its job is scancelled) keeps the record, and so does a step
whose own sbatch failed (an earlier supervisor's record: SLURM's controller may have been
away while the job it names still runs). A record that is
still there when the train step of the same site and round starts was left by an earlier
supervisor: a killed coordinator, a cron tick after one, ``xffl cancel``. Then:

* the job is still queued or running in SLURM (upstream's own polling, as a late job's
  adoption asks): the step adopts it, polls it to its end and moves its ``update/`` into its
  own folder (:mod:`xffl.workflows.steps.late` does the same for a job left late); no second
  sbatch;
* it ended: the step submits a new job. It continues from the site's newest complete
  checkpoint of the same run, round and global (:mod:`xffl.training.round_state`), or, if the
  ended job finished, hands back the update the launcher kept (``--keep``), without training.
  The ended job's own update is never taken: SLURM may have forgotten its exit code, and the
  new job's is as cheap, goes through the same copy-back and admission as any update, and
  leaves no doubt about which job's folder it came from.

Each case is a registry event (``inflight``) and a line of streamflow.log. Every file here
is written by the coordinator, never by a site.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xffl.core.files import write_json
from xffl.core.layout import RunLayout, registration
from xffl.site_profiles.schema import shell_unsafe_char
from xffl.workflows.steps.late import is_job_id

EVENT = "inflight"


@dataclass(frozen=True)
class InflightJob:
    """A site's train job of one round as the coordinator submitted it."""

    site: str
    round: int
    job_id: str  # what sbatch --parsable answered: digits only
    workdir: str  # the job's folder at the site, where it writes update/
    submitted_at: float = field(default_factory=time.time)
    supervisor: int = field(default_factory=os.getpid)  # the process that submitted it


def record_submitted(layout: RunLayout, job: InflightJob) -> Path:
    """Record ``job`` as submitted (ValueError: its id is not a plain SLURM job id or its
    folder not plain path text, which a later supervisor passes to squeue and mv)."""
    if not is_job_id(job.job_id):
        raise ValueError(f"{job.job_id!r} is not a SLURM job id")
    if shell_unsafe_char(job.workdir) is not None:
        raise ValueError(f"the job folder {job.workdir!r} is not plain path text")
    path = layout.inflight_job(job.round, job.site)
    write_json(path, asdict(job))
    return path


def read_inflight(layout: RunLayout, rnd: int, site: str) -> InflightJob | None:
    """``site``'s job of round ``rnd`` recorded at submission and not ended for its step
    (None: none, or a record that is not one: the step then submits)."""
    path = layout.inflight_job(rnd, site)
    try:
        data = json.loads(path.read_text())
        job = InflightJob(site=str(data["site"]), round=int(data["round"]),
                          job_id=str(data["job_id"]), workdir=str(data["workdir"]),
                          submitted_at=float(data["submitted_at"]),
                          supervisor=int(data["supervisor"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        note(layout, f"round {rnd}: {site}: the record {path.name} of its job in flight is "
             f"unreadable ({type(exc).__name__}); a new job is submitted")
        return None
    if (job.site, job.round) != (site, rnd) or not is_job_id(job.job_id) \
            or shell_unsafe_char(job.workdir) is not None:
        note(layout, f"round {rnd}: {site}: the record {path.name} of its job in flight "
             "names another site or round, or is not a plain job id and path; a new job is "
             "submitted")
        return None
    return job


def clear_inflight(layout: RunLayout, rnd: int, site: str) -> None:
    """The step of ``site`` in round ``rnd`` has its job's outcome: no job in flight."""
    layout.inflight_job(rnd, site).unlink(missing_ok=True)


def adopted_message(job: InflightJob) -> str:
    """What the registry and streamflow.log say when a step adopts ``job``."""
    return (f"round {job.round}: {job.site}: SLURM job {job.job_id} (submitted by supervisor "
            f"pid {job.supervisor}) is still queued or running: adopted, no second job "
            "submitted")


def resubmitted_message(job: InflightJob) -> str:
    """What the registry and streamflow.log say when ``job`` ended without its step."""
    return (f"round {job.round}: {job.site}: SLURM job {job.job_id} (submitted by supervisor "
            f"pid {job.supervisor}) ended while no supervisor waited for it: a new job is "
            "submitted, continuing from the site's checkpoint of the round")


def note(layout: RunLayout, message: str) -> None:
    """``message`` as a registry event of the run (if registered) and a streamflow.log line."""
    from streamflow.log_handler import logger

    logger.info(f"xffl: {message}")
    reg = registration(layout)
    if reg is None:
        return
    from xffl.jobs.registry.store import Registry

    Registry(reg.registry).event(reg.run_id, EVENT, message)
