"""SLURM's view of a run: its jobs at every SLURM site, read live over SSH.

Each SLURM site's train job is named ``xffl-<run_id>-<site>`` (workflows/plan.py), so
``squeue -n`` finds it without knowing the job id. The site profiles come from the run
directory's ``profiles.json`` (written with the plan). Every SSH call is bounded; a site that
cannot be reached is reported as such, never raised to the caller.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from xffl.core.errors import ConnectionFailed
from xffl.jobs.registry import Registry, RunRecord
from xffl.site_profiles import remote
from xffl.site_profiles.schema import SiteProfile, SshConnector

SSH_TIMEOUT = 10.0
SQUEUE_FORMAT = "%i|%T|%V|%S|%M"


class SiteUnreachable(Exception):
    """SSH to a site failed (connection, authentication, host key or timeout)."""


def job_name(run_id: str, site: str) -> str:
    """The SLURM job name of ``site``'s train job in ``run_id``."""
    return f"xffl-{run_id}-{site}"


def load_profiles(run_dir: Path) -> dict[str, SiteProfile]:
    """The resolved site profiles of a run (empty for runs planned before profiles.json)."""
    path = Path(run_dir) / "profiles.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {name: SiteProfile.model_validate(p) for name, p in data.items()}


def slurm_sites(run_dir: Path) -> dict[str, SiteProfile]:
    """The run's SLURM sites reached over SSH, by name."""
    return {n: p for n, p in load_profiles(run_dir).items()
            if p.slurm is not None and isinstance(p.connector, SshConnector)}


def ssh_run(profile: SiteProfile, command: str,
            timeout: float = SSH_TIMEOUT) -> tuple[int, str, str]:
    """Run ``command`` on the site's login node: (exit status, stdout, stderr).

    The connection is site_profiles.remote's (host keys always verified); any failure to
    reach the site becomes SiteUnreachable, so callers can show it instead of crashing.
    """
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


def _seconds(text: str) -> float | None:
    """SLURM's elapsed time ([D-]HH:MM:SS, MM:SS) in seconds."""
    text = text.strip()
    if not text or text in {"N/A", "INVALID"}:
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    return float(days * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2])


def _time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        return None


@dataclass
class SlurmJob:
    """One site's job as SLURM sees it (or why it could not be seen)."""

    site: str
    round: int | None
    job_id: str | None = None
    state: str | None = None
    queue_wait_s: float | None = None
    run_s: float | None = None
    reachable: bool = True
    error: str = ""
    live: bool = True  # False: as recorded in the registry when SLURM was last asked

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return asdict(self)


def parse_squeue(site: str, rnd: int | None, text: str) -> list[SlurmJob]:
    """Parse ``date +%Y-%m-%dT%H:%M:%S`` followed by squeue lines in SQUEUE_FORMAT."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    now = _time(lines[0]) if lines else None
    jobs = []
    for line in lines[1:]:
        fields = line.split("|")
        if len(fields) != 5:
            continue
        job_id, state, submit, start, elapsed = fields
        sub, sta = _time(submit), _time(start)
        if sub is not None and sta is not None and state != "PENDING":
            wait: float | None = max(0.0, (sta - sub).total_seconds())
        elif sub is not None and now is not None:
            wait = max(0.0, (now - sub).total_seconds())
        else:
            wait = None
        jobs.append(SlurmJob(site=site, round=rnd, job_id=job_id, state=state,
                             queue_wait_s=wait, run_s=_seconds(elapsed)))
    return jobs


def query_site(run_id: str, site: str, profile: SiteProfile, rnd: int | None,
               timeout: float = SSH_TIMEOUT) -> list[SlurmJob]:
    """The site's jobs of this run that squeue still lists (an unreachable marker on error)."""
    cmd = (f"date +%Y-%m-%dT%H:%M:%S; squeue -h -n {shlex.quote(job_name(run_id, site))} "
           f"-o {shlex.quote(SQUEUE_FORMAT)}")
    try:
        rc, out, err = ssh_run(profile, cmd, timeout)
    except SiteUnreachable as exc:
        return [SlurmJob(site=site, round=rnd, reachable=False, error=str(exc))]
    if rc != 0:
        return [SlurmJob(site=site, round=rnd, error=f"squeue failed: {err.strip()[:200]}")]
    return parse_squeue(site, rnd, out)


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
            if job.job_id and job.state:
                registry.record_slurm_job(run.id, rnd, site, job.job_id, job.state,
                                          job.queue_wait_s, job.run_s)
        jobs.extend(found)
    return jobs


def recorded_view(registry: Registry, run: RunRecord) -> list[SlurmJob]:
    """What the registry last recorded about the run's SLURM jobs."""
    return [SlurmJob(site=r["site"], round=r["round"], job_id=r["job_id"], state=r["state"],
                     queue_wait_s=r["queue_wait_s"], run_s=r["run_s"], live=False)
            for r in registry.slurm_jobs(run.id)]


def slurm_view(registry: Registry, run: RunRecord, live: bool = True) -> list[dict[str, Any]]:
    """SLURM's view of a run: live over SSH while it runs, else the recorded jobs.

    Rows from the registry for earlier rounds come first; live rows replace those of the
    round in flight.
    """
    if not slurm_sites(Path(run.run_dir)):
        return []
    recorded = recorded_view(registry, run)
    if live and not run.finished:
        current = live_view(registry, run)
        rnd = in_flight_round(run)
        recorded = [j for j in recorded if j.round != rnd] + current
    return [j.as_dict() for j in recorded]
