"""SLURM's own estimate of a site's queue wait, taken before the first round.

``sbatch --test-only`` with the site's round settings (nodes, tasks, time limit and its other
sbatch options) asks the facility's scheduler when such a job would start, without
submitting one. The seconds from the login node's own clock (``date``, printed first, so the
two clocks never mix) to that start are the site's seed queue wait
(:mod:`xffl.jobs.report.estimates`). The command and the parser of SLURM's answer (a
facility's text, not trusted) are SLURM's dialect, in :mod:`xffl.schedulers.slurm_login`.
"""

from __future__ import annotations

from pathlib import Path

from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import SLURM_SOURCE
from xffl.schedulers.registry import scheduler
from xffl.site_profiles.schema import SiteProfile, SlurmSpec

SLURM = scheduler("slurm")


def estimate_command(slurm: SlurmSpec, ranks: int) -> str:
    """The login-node shell line: the clock, then ``sbatch --test-only`` of a round's job."""
    return SLURM.estimate_command(slurm.nodes, ranks, slurm.time, slurm.sbatch_options())


def parse_test_only(text: str) -> float | None:
    """Seconds from the login node's clock (first line) to SLURM's estimated start, or None."""
    return SLURM.parse_estimate(text)


def slurm_estimate(profile: SiteProfile, ranks: int) -> float | None:
    """SLURM's estimated queue wait of a round's job at the site (None: none, or unreachable)."""
    from xffl.jobs.slurm_view import SiteUnreachable, ssh_run

    scheduler, batch = profile.scheduler, profile.batch
    if scheduler is None or batch is None:
        return None
    command = scheduler.estimate_command(batch.nodes, ranks, batch.time, profile.batch_options())
    try:
        rc, out, _ = ssh_run(profile, command)
    except SiteUnreachable:
        return None
    return scheduler.parse_estimate(out) if rc == 0 else None


def seed_estimates(registry: Registry, run: RunRecord, ranks: dict[str, int]) -> dict[str, float]:
    """Ask every SLURM site of ``run`` for its estimate and record it as the site's seed.

    ``ranks``: each site's training processes. A site that gives no estimate is left out
    (its queue-wait average starts from its first recorded round) and said so in the log.
    """
    from xffl.jobs.slurm_view import slurm_sites

    found = {}
    for site, profile in slurm_sites(Path(run.run_dir)).items():
        seconds = slurm_estimate(profile, ranks.get(site, 1))
        if seconds is None:
            registry.event(run.id, "estimate", f"{site}: SLURM gave no start estimate")
            continue
        registry.record_queue_estimate(run.id, site, seconds, SLURM_SOURCE)
        registry.event(run.id, "estimate", f"{site}: SLURM estimates a queue wait of "
                       f"{seconds:.0f} s ({SLURM_SOURCE})")
        found[site] = seconds
    return found
