"""SLURM's own estimate of a site's queue wait, taken before the first round.

``sbatch --test-only`` with the site's round settings (nodes, tasks, time limit and its other
sbatch options) asks the facility's scheduler when such a job would start, without
submitting one. It answers on its standard error::

    sbatch: Job 4 to start at 2026-11-26T00:16:03 using 2 processors on nodes n1 in partition debug

The seconds from the login node's own clock (``date``, printed first, so the two clocks
never mix) to that start are the site's seed queue wait (:mod:`xffl.jobs.report.estimates`). The
facility's text is not trusted: only a line of exactly that form counts, a time that is not
an ISO date and time is no estimate, and so is one more than a year away.
"""

from __future__ import annotations

import re
import shlex
from datetime import datetime
from pathlib import Path

from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import SLURM_SOURCE
from xffl.site_profiles.schema import SiteProfile, SlurmSpec

MAX_ESTIMATE_S = 366 * 86400.0
MAX_LINES = 64  # what is read of the answer (sbatch prints one line)
_ISO = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}"
_NOW = re.compile(_ISO)
_ANSWER = re.compile(rf"sbatch: Job \d{{1,12}} to start at ({_ISO}) using \d{{1,9}} processors"
                     r" on nodes [\w\[\]\-,.]{1,1000} in partition [\w\-.]{1,64}")


def estimate_command(slurm: SlurmSpec, ranks: int) -> str:
    """The login-node shell line: the clock, then ``sbatch --test-only`` of a round's job."""
    argv = ["sbatch", "--test-only", f"--nodes={slurm.nodes}", f"--ntasks={ranks}",
            f"--time={slurm.time}", *slurm.sbatch_options(), "--wrap=true"]
    return "date +%Y-%m-%dT%H:%M:%S; " + " ".join(shlex.quote(a) for a in argv) + " 2>&1"


def parse_test_only(text: str) -> float | None:
    """Seconds from the login node's clock (first line) to SLURM's estimated start, or None."""
    lines = text.splitlines()[:MAX_LINES]
    if not lines or _NOW.fullmatch(lines[0].strip()) is None:
        return None
    try:
        now = datetime.fromisoformat(lines[0].strip())
    except ValueError:
        return None
    for line in lines[1:]:
        match = _ANSWER.fullmatch(line.strip())
        if match is None:
            continue
        try:
            start = datetime.fromisoformat(match.group(1))
        except ValueError:  # 2026-13-45T99:...: digits in the right places, no time
            return None
        seconds = max(0.0, (start - now).total_seconds())
        return seconds if seconds <= MAX_ESTIMATE_S else None
    return None


def slurm_estimate(profile: SiteProfile, ranks: int) -> float | None:
    """SLURM's estimated queue wait of a round's job at the site (None: none, or unreachable)."""
    from xffl.jobs.slurm_view import SiteUnreachable, ssh_run

    if profile.slurm is None:
        return None
    try:
        rc, out, _ = ssh_run(profile, estimate_command(profile.slurm, ranks))
    except SiteUnreachable:
        return None
    return parse_test_only(out) if rc == 0 else None


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
