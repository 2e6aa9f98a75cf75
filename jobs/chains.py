"""Rounds that span several jobs (``training.checkpoint.chain``) for ``xffl status``: each
chained round's jobs and steps, and for a round in flight the steps done and an ETA."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xffl.core.layout import RunLayout
from xffl.jobs.registry.attempts import eta_seconds, read_attempts
from xffl.jobs.registry.records import RunRecord

if TYPE_CHECKING:
    from xffl.jobs.slurm_view import SlurmJob


@dataclass(frozen=True)
class RoundChain:
    """One site's chained round: its jobs so far, the steps done of the round's, an ETA."""

    round: int
    site: str
    jobs: int
    steps_done: int
    steps: int | None
    # seconds of training left (steps left at the last job's seconds a step; the queue
    # waits of the jobs to come are not in it); None when done or unknown
    eta_s: float | None
    done: bool

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return asdict(self)


def round_chains(run: RunRecord, slurm: list[SlurmJob]) -> list[RoundChain]:
    """The run's chained rounds: finished ones from their recorded jobs (steps from-to),
    the round in flight from the failure manager's record of its continued jobs."""

    by_site: dict[tuple[int, str], list[SlurmJob]] = {}
    for job in slurm:
        if job.round is not None and job.step_to is not None:
            by_site.setdefault((job.round, job.site), []).append(job)
    chains = [RoundChain(round=rnd, site=site, jobs=len(jobs),
                         steps_done=max(j.step_to or 0 for j in jobs),
                         steps=max(j.step_to or 0 for j in jobs), eta_s=None, done=True)
              for (rnd, site), jobs in sorted(by_site.items()) if len(jobs) > 1]
    if run.finished:
        return chains
    layout = RunLayout(Path(run.run_dir))
    rnd = min(run.rounds_done + 1, run.rounds_total)
    for site in run.sites:
        if (rnd, site) in by_site:
            continue
        record = read_attempts(layout, rnd, site)
        if record is None or record.continued == 0:
            continue
        chains.append(RoundChain(round=rnd, site=site, jobs=record.continued + 1,
                                 steps_done=record.best_step, steps=record.steps or None,
                                 eta_s=eta_seconds(record), done=False))
    return chains
