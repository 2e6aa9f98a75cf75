"""Per-site estimators of a round's time: queue wait, start-up and seconds per step.

Each is an exponentially weighted moving average over the site's delivered rounds, oldest
first, from what xffl records: the queue wait SLURM reported for the site's jobs of the
round (:class:`xffl.jobs.report.numbers.QueueWaits`; 0 at a site without SLURM), the start-up the
site measured, and the seconds per optimizer step of its update (``train_seconds / steps``
of the update's manifest, kept in ``rounds/<r>/updates/<site>``):

    s_0 = seed (the queue wait: SLURM's own estimate before round 1, where one was taken;
          else the first observation)
    s_k = alpha x_k + (1 - alpha) s_(k-1)

``alpha`` (:data:`ALPHA`) weighs the latest round; queue waits change by the hour, so the
estimate follows them within a few rounds. A round deadline
(:mod:`xffl.workflows.steps.deadline`) sizes each site's local steps from these numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xffl.aggregator.metrics import STEPS, TRAIN_SECONDS
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.breakdown import QueueWaits

ALPHA = 0.5
SLURM_SOURCE = "sbatch --test-only"  # how the seed was taken (the registry's source column)


def ewma(values: Iterable[float], alpha: float = ALPHA, seed: float | None = None) -> float | None:
    """The exponentially weighted moving average of ``values`` (oldest first) from ``seed``.

    None when there is neither a seed nor a value.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    s = seed
    for x in values:
        s = x if s is None else alpha * x + (1 - alpha) * s
    return s


def per_step_seconds(run_dir: Path, rnd: int, site: str) -> float | None:
    """Seconds per step of ``site``'s update kept for round ``rnd`` (None if none).

    The manifest was written by the site: anything that is not a positive finite speed is no
    measurement (never an exception here).
    """
    from xffl.aggregator.exchange import MANIFEST_FILE  # (its numpy: only when one is read)

    manifest = Path(run_dir) / "rounds" / str(rnd) / "updates" / site / MANIFEST_FILE
    try:
        metrics = json.loads(manifest.read_text()).get("metrics", {})
    except (OSError, ValueError):
        return None
    try:
        steps = float(metrics.get(STEPS))
        seconds = float(metrics.get(TRAIN_SECONDS))
        per_step = seconds / steps
    except (AttributeError, TypeError, ValueError, ZeroDivisionError, OverflowError):
        return None
    return per_step if steps > 0 and math.isfinite(per_step) and per_step > 0 else None


@dataclass(frozen=True)
class SiteEstimate:
    """What one site's next round is expected to take, and what it was estimated from."""

    site: str
    queue_wait_s: float | None = None
    startup_s: float | None = None
    seconds_per_step: float | None = None
    rounds_seen: int = 0  # delivered rounds the averages are over
    slurm_estimate_s: float | None = None  # SLURM's own estimate before round 1 (the seed)

    def expected_seconds(self, steps: int) -> float | None:
        """Queue wait + start-up + ``steps`` x seconds per step; None without a step time."""
        if self.seconds_per_step is None:
            return None
        return (self.queue_wait_s or 0.0) + (self.startup_s or 0.0) + \
            steps * self.seconds_per_step

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return asdict(self)


def _finite(values: Iterable[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v) and v >= 0]


def site_estimates(registry: Registry, run: RunRecord,
                   alpha: float = ALPHA) -> list[SiteEstimate]:
    """Every site's estimates from the run's recorded rounds (and SLURM's seed), in run order."""
    rounds = registry.rounds(run.id)
    waits = QueueWaits.of(registry, run)
    seeds = registry.queue_estimates(run.id)
    out = []
    for site in run.sites:
        delivered = [(r.round, s) for r in rounds for s in r.sites
                     if s.site == site and SiteState(s.state).delivered]
        queue = _finite(waits.get(rnd, site) for rnd, _ in delivered)
        startup = _finite(s.startup_seconds for _, s in delivered)
        speed = _finite(per_step_seconds(Path(run.run_dir), rnd, site) for rnd, _ in delivered)
        seed = seeds.get(site)
        out.append(SiteEstimate(
            site=site, queue_wait_s=ewma(queue, alpha, seed), startup_s=ewma(startup, alpha),
            seconds_per_step=ewma(speed, alpha), rounds_seen=len(delivered),
            slurm_estimate_s=seed))
    return out
