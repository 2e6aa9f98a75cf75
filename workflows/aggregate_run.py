"""What ``xffl aggregate --run RUN --round R`` takes from a run: the round's kept updates, the
global the round started from, and the aggregation options and report bounds of its job, as
the round's own admit and aggregate steps had them (:mod:`xffl.workflows.plan.compile`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from xffl.aggregator.reported import Bounds
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.plan.compile import report_bounds
from xffl.workflows.steps.admit import SIDE_FILES


@dataclass(frozen=True)
class RoundInputs:
    """One round of a run as its aggregate step saw it."""

    updates: list[Path]  # rounds/<r>/updates/<site>, the admitted updates under our names
    previous: Path  # rounds/<r-1>/global
    strategy: str
    weighting: str
    params: dict[str, float]
    max_shard_size: str
    clip_norm: float | None
    max_weight_share: float | None
    exchange: str  # update/dtype
    bounds: dict[str, Bounds] = field(default_factory=dict)  # each site's, by name


def job_spec(run_dir: Path) -> JobSpec:
    """The run's job spec as resolved at submit (job.json)."""
    return JobSpec.of_run(run_dir)


def site_bounds(spec: JobSpec) -> dict[str, Bounds]:
    """What each site's update may report in a round of ``spec`` (its admit step's bounds)."""
    out: dict[str, Bounds] = {}
    for site in spec.sites:
        tokens, samples, held_out, seq_len = report_bounds(spec, site)
        out[site.name] = Bounds(max_tokens=tokens, max_samples=samples, side_files=SIDE_FILES,
                                max_val_samples=held_out, val_seq_len=seq_len)
    return out


def round_inputs(run_id: str, run_dir: Path, rnd: int) -> RoundInputs:
    """Round ``rnd`` of the run in ``run_dir``: exit 2 when it kept no updates of that round."""
    layout = RunLayout(run_dir)
    kept = layout.round_dir(rnd) / "updates"
    updates = sorted(p for p in kept.iterdir() if p.is_dir()) if rnd >= 1 and kept.is_dir() \
        else []
    if not updates:
        done = sorted(int(p.parent.name) for p in (run_dir / "rounds").glob("*/updates")
                      if p.parent.name.isdigit())
        have = f"rounds {', '.join(map(str, done))}" if done else "no round yet"
        raise InvalidInput(f"--round {rnd}: run {run_id} kept no aggregated updates of that "
                           f"round ({have}); give one of those.")
    spec = job_spec(run_dir)
    agg = spec.aggregation
    return RoundInputs(
        updates=updates, previous=layout.global_dir(rnd - 1), strategy=agg.strategy,
        weighting=agg.weighting, params=dict(agg.params),
        max_shard_size=str(agg.max_shard_size), clip_norm=agg.clip_norm,
        max_weight_share=agg.max_weight_share, exchange=spec.exchange.label(),
        bounds=site_bounds(spec))
