"""SLURM's view of a run: its jobs at every SLURM site, read live over SSH, and as recorded.

The job that trains round r at a SLURM site is named ``xffl-<run_id>-<site>-r<r>``: the
runner submits it under that name, and the launcher renames a job submitted under the bare
prefix ``xffl-<run_id>-<site>`` (a batch script run by hand). squeue cannot match a name
prefix, so the user's jobs are listed with their names (SLURM's own listing and its parser:
:mod:`xffl.schedulers.slurm_login`) and filtered here
(:func:`xffl.core.names.slurm_job_round`); the round comes from the name. Every finished
job is also recorded from the ``slurm_job.json`` its update brought back
(:func:`record_delivered`), so status shows every round's job id after the jobs left squeue.
The site profiles come from the run directory's ``profiles.json`` (written with the plan).
Every SSH call is bounded; a site that cannot be reached is reported as such, never raised.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xffl.core.errors import ConnectionFailed
from xffl.core.layout import RunLayout
from xffl.core.names import slurm_job_name, slurm_job_round
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry
from xffl.schedulers.base import Scheduler
from xffl.schedulers.registry import scheduler
from xffl.site_profiles.schema import SiteProfile, SshConnector

SSH_TIMEOUT = 10.0
SLURM = scheduler("slurm")
#: the state recorded of a job that ended a chained round early to continue it (SLURM's own
#: is FAILED: it exited 75)
CONTINUED = "CONTINUED"


class SiteUnreachable(Exception):
    """SSH to a site failed (connection, authentication, host key or timeout)."""


def job_name(run_id: str, site: str, rnd: int | None = None) -> str:
    """The SLURM job name of ``site``'s train job of round ``rnd`` in ``run_id``.

    ``xffl-<run>-<site>-r<round>``; without a round, the prefix ``xffl-<run>-<site>``.
    """
    return slurm_job_name(run_id, site, rnd)


def job_ids_command(run_id: str, site: str, scheduler: Scheduler = SLURM) -> str:
    """A shell line printing the ids of every job of ``site`` in ``run_id`` (any round).

    It matches the prefix itself and the prefix followed by ``-r<digits>``, nothing else.
    """
    return scheduler.job_ids_command(job_name(run_id, site))


def load_profiles(run_dir: Path) -> dict[str, SiteProfile]:
    """The resolved site profiles of a run (empty for runs planned before profiles.json)."""
    path = RunLayout(Path(run_dir)).profiles
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {name: SiteProfile.model_validate(p) for name, p in data.items()}


def slurm_sites(run_dir: Path) -> dict[str, SiteProfile]:
    """The run's SLURM sites reached over SSH, by name."""
    return {n: p for n, p in load_profiles(run_dir).items()
            if p.scheduler is not None and isinstance(p.connector, SshConnector)}


def ssh_run(profile: SiteProfile, command: str,
            timeout: float = SSH_TIMEOUT) -> tuple[int, str, str]:
    """Run ``command`` on the site's login node: (exit status, stdout, stderr).

    The connection is site_profiles.remote's (host keys always verified); any failure to
    reach the site becomes SiteUnreachable, so callers can show it instead of crashing.
    """
    from xffl.site_profiles import remote

    try:
        client = remote.connect(profile)
    except ConnectionFailed as exc:
        raise SiteUnreachable(exc.message) from exc
    try:
        rc, out, err = remote.run(client, command, timeout=timeout)
    finally:
        client.close()
    if rc in (124, 255) and not out:
        raise SiteUnreachable(err or f"command failed with status {rc}")
    return rc, out, err


@dataclass
class SlurmJob:
    """One site's job as SLURM sees it (or why it could not be seen)."""

    site: str
    round: int | None
    job_id: str | None = None
    name: str = ""
    nodes: str = ""
    state: str | None = None
    queue_wait_s: float | None = None
    run_s: float | None = None
    reachable: bool = True
    error: str = ""
    live: bool = True  # False: as recorded in the registry when SLURM was last asked
    # a chained round's job (training.checkpoint.chain): the round's steps it took, from-to
    step_from: int | None = None
    step_to: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return asdict(self)


def parse_squeue(run_id: str, site: str, text: str, rnd: int | None = None,
                 scheduler: Scheduler = SLURM) -> list[SlurmJob]:
    """Parse the clock line and squeue's lines (:meth:`Slurm.parse_list`): ``site``'s jobs.

    Only jobs named for ``site`` in ``run_id`` are kept; a job's round comes from its name
    (``rnd`` for a job still named with the bare prefix). A facility's text is not trusted:
    a line whose id, state or node list is not SLURM's is skipped, and a time or elapsed
    field that is not SLURM's counts as unknown.
    """
    jobs = []
    for job in scheduler.parse_list(text):
        job_round = slurm_job_round(job.name, run_id, site)
        if job_round is None:
            continue
        jobs.append(SlurmJob(site=site, round=job_round or rnd, job_id=job.job_id,
                             name=job.name, nodes=job.nodes, state=job.state,
                             queue_wait_s=job.queue_wait_s, run_s=job.run_s))
    return jobs


def query_site(run_id: str, site: str, profile: SiteProfile, rnd: int | None = None,
               timeout: float = SSH_TIMEOUT) -> list[SlurmJob]:
    """The site's jobs of this run that squeue still lists (an unreachable marker on error).

    ``rnd`` is the round of a job still named with the bare prefix (and of the markers).
    """
    sched = profile.scheduler or SLURM
    try:
        rc, out, err = ssh_run(profile, sched.list_command(), timeout)
    except SiteUnreachable as exc:
        return [SlurmJob(site=site, round=rnd, reachable=False, error=str(exc))]
    if rc != 0:
        return [SlurmJob(site=site, round=rnd, error=f"squeue failed: {err.strip()[:200]}")]
    return parse_squeue(run_id, site, out, rnd, sched)


def record_delivered(registry: Registry, run_id: str, rnd: int, site: str,
                     update_dir: Path) -> bool:
    """Record the SLURM job that trained ``update_dir`` (its slurm_job.json); False if none."""
    from xffl.training.slurm_job import ROUND_JOBS, read_record

    job = read_record(update_dir)
    if job is None:
        return False
    state = "COMPLETED" if job.get("exit_code", 0) == 0 else "FAILED"

    def seconds(key: str) -> float | None:  # a number, or nothing: the site wrote the file
        value = job.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    chained = {str(j["job_id"]): j for j in job.get(ROUND_JOBS) or [] if j["job_id"]}
    for job_id, earlier in chained.items():  # a chained round's jobs (validated on reading)
        if job_id != str(job["job_id"]):
            registry.record_slurm_job(run_id, rnd, site, job_id, CONTINUED,
                                      earlier["queue_wait_s"], earlier["run_s"],
                                      steps=(earlier["step_from"], earlier["step_to"]))
    last = chained.get(str(job["job_id"]))
    registry.record_slurm_job(run_id, rnd, site, str(job["job_id"]), state,
                              seconds("queue_wait_s"), seconds("run_s"),
                              name=str(job.get("job_name") or ""),
                              nodes=str(job.get("node_list") or ""),
                              steps=None if last is None else (last["step_from"],
                                                               last["step_to"]))
    return True


def in_flight_round(run: RunRecord) -> int:
    """The round a running run is working on."""
    return min(run.rounds_done + 1, run.rounds_total)


def live_view(registry: Registry, run: RunRecord, timeout: float = SSH_TIMEOUT) -> list[SlurmJob]:
    """Query every SLURM site of a running run and record what SLURM said in the registry."""
    rnd = in_flight_round(run)
    jobs: list[SlurmJob] = []
    for site, profile in slurm_sites(Path(run.run_dir)).items():
        found = query_site(run.id, site, profile, rnd, timeout)
        if not found:
            found = [SlurmJob(site=site, round=rnd, error="no job in squeue")]
        for job in found:
            if job.job_id and job.state and job.round is not None:
                registry.record_slurm_job(run.id, job.round, site, job.job_id, job.state,
                                          job.queue_wait_s, job.run_s, name=job.name,
                                          nodes=job.nodes)
        jobs.extend(found)
    return jobs


def recorded_view(registry: Registry, run: RunRecord) -> list[SlurmJob]:
    """What the registry last recorded about the run's SLURM jobs."""
    return [SlurmJob(site=r["site"], round=r["round"], job_id=r["job_id"], name=r["name"],
                     nodes=r["nodes"], state=r["state"], queue_wait_s=r["queue_wait_s"],
                     run_s=r["run_s"], live=False, step_from=r["step_from"],
                     step_to=r["step_to"])
            for r in registry.slurm_jobs(run.id)]


def rounds_left(run: RunRecord) -> bool:
    """Whether a running run has a round to train: not after its last round or an early
    stop, while its final global is evaluated (whose jobs are no round's)."""
    from xffl.core.layout import RunLayout

    return run.rounds_done < run.rounds_total and not RunLayout(Path(run.run_dir)).stopped.exists()


def slurm_view(registry: Registry, run: RunRecord, live: bool = True) -> list[SlurmJob]:
    """SLURM's view of a run: live over SSH while it runs, else the recorded jobs.

    Rows from the registry come first; live rows replace those of the same round and site
    (the round in flight, for a site where squeue lists nothing).
    """
    if not slurm_sites(Path(run.run_dir)):
        return []
    recorded = recorded_view(registry, run)
    if live and not run.finished and rounds_left(run):
        current = live_view(registry, run)
        seen = {(j.round, j.site) for j in current}
        recorded = [j for j in recorded if (j.round, j.site) not in seen] + current
    return recorded
