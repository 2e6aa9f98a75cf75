"""The numbers of `xffl report` and `xffl status`: loss, round-time breakdown and throughput.

Every figure comes from the run registry. A site's round is broken down as
``queue wait + training + transfer/orchestration = delivered``: the queue wait is SLURM's
(summed over the site's jobs of the round, retries included; 0 at a site without SLURM), the
training is the trainer's own loop time, and the delivery time is when the site's update was
in place on the coordinator, counted from the round's start; what is left is moving models
in and out, starting the job and the processes, and StreamFlow's orchestration. The round's
aggregation follows. The report itself (PNG plots and one HTML page) is drawn by
:mod:`xffl.jobs.report_render` and written atomically by
:func:`xffl.jobs.report_write.write_report`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xffl.jobs.profiles_json import slurm_site_names
from xffl.jobs.registry import Registry, RunRecord, SiteRound

REPORT_FILES = ("loss.png", "breakdown.png", "throughput.png", "report.html")
# how the table (HTML and `xffl status`) prints each number; "-" when it is not known
FORMATS = {"num_samples": "{}", "num_tokens": "{}", "loss": "{:.4f}", "train_s": "{:.1f}",
           "queue_wait_s": "{:.1f}", "transfer_s": "{:.1f}", "aggregate_s": "{:.2f}",
           "tokens_per_s": "{:.0f}", "delivered_s": "{:.1f}"}


def fmt(key: str, value: float | int | None) -> str:
    """``value`` as the report's table prints the column ``key`` (``-`` when unknown)."""
    return "-" if value is None else FORMATS[key].format(value)


@dataclass
class QueueWaits:
    """SLURM's queue wait of each site's round, as recorded in the registry."""

    recorded: dict[tuple[int, str], float] = field(default_factory=dict)
    slurm_sites: frozenset[str] = frozenset()

    @classmethod
    def of(cls, registry: Registry, run: RunRecord) -> QueueWaits:
        """The recorded waits of ``run`` (summed over a site's jobs of one round)."""
        recorded: dict[tuple[int, str], float] = {}
        for job in registry.slurm_jobs(run.id):
            if job["queue_wait_s"] is not None:
                key = (int(job["round"]), str(job["site"]))
                recorded[key] = recorded.get(key, 0.0) + float(job["queue_wait_s"])
        return cls(recorded, slurm_site_names(Path(run.run_dir)))

    def get(self, rnd: int, site: str) -> float | None:
        """The site's queue wait in round ``rnd``: 0 without SLURM, None when not known."""
        if (rnd, site) in self.recorded:
            return self.recorded[(rnd, site)]
        return None if site in self.slurm_sites else 0.0


@dataclass
class Breakdown:
    """Where one site's round went, in seconds, and its training throughput."""

    queue_wait_s: float | None = None
    train_s: float | None = None
    transfer_s: float | None = None
    delivered_s: float | None = None
    tokens_per_s: float | None = None


def site_breakdown(site: SiteRound, queue_wait_s: float | None) -> Breakdown:
    """Split the site's delivery time into queue wait, training and transfer/orchestration.

    The transfer part is what the delivery time leaves (never below 0); it is None unless the
    delivery time, the queue wait and the training time are all known.
    """
    train, delivered = site.train_seconds, site.delivered_seconds
    transfer = None
    if train is not None and delivered is not None and queue_wait_s is not None:
        transfer = max(0.0, delivered - queue_wait_s - train)
    rate = None
    if site.num_tokens is not None and train:
        rate = site.num_tokens / train
    return Breakdown(queue_wait_s=queue_wait_s, train_s=train, transfer_s=transfer,
                     delivered_s=delivered, tokens_per_s=rate)


@dataclass
class SiteRow:
    """One site's round in the report."""

    site: str
    state: str
    num_samples: int | None
    num_tokens: int | None
    loss: float | None
    attempts: int
    reason: str
    queue_wait_s: float | None
    train_s: float | None
    transfer_s: float | None
    delivered_s: float | None
    tokens_per_s: float | None


@dataclass
class RoundRow:
    """One round in the report: the global result and every site's."""

    round: int
    state: str
    num_samples: int | None
    loss: float | None
    aggregate_s: float | None
    wall_s: float | None
    sites: list[SiteRow]


@dataclass
class ReportData:
    """Everything the report shows about one run."""

    run_id: str
    name: str
    state: str
    message: str
    rounds_done: int
    rounds_total: int
    sites: list[str]
    run_dir: str
    rounds: list[RoundRow]

    def site_names(self) -> list[str]:
        """The run's sites, then any other site the registry recorded, in order."""
        names = list(self.sites)
        for rnd in self.rounds:
            names += [s.site for s in rnd.sites if s.site not in names]
        return names

    def as_dict(self) -> dict[str, Any]:
        """A plain dict for JSON output."""
        return asdict(self)


def assemble(registry: Registry, run: RunRecord) -> ReportData:
    """Read the run's rounds, sites and SLURM jobs from the registry into the report's rows."""
    waits = QueueWaits.of(registry, run)
    rounds = []
    for rnd in registry.rounds(run.id):
        rows = []
        for s in rnd.sites:
            b = site_breakdown(s, waits.get(rnd.round, s.site))
            rows.append(SiteRow(site=s.site, state=s.state, num_samples=s.num_samples,
                                num_tokens=s.num_tokens, loss=s.loss, attempts=s.attempts,
                                reason=s.reason, queue_wait_s=b.queue_wait_s, train_s=b.train_s,
                                transfer_s=b.transfer_s, delivered_s=b.delivered_s,
                                tokens_per_s=b.tokens_per_s))
        wall = (rnd.ended - rnd.started
                if rnd.ended is not None and rnd.started is not None else None)
        rounds.append(RoundRow(round=rnd.round, state=rnd.state, num_samples=rnd.num_samples,
                               loss=rnd.loss, aggregate_s=rnd.aggregate_seconds, wall_s=wall,
                               sites=rows))
    return ReportData(run_id=run.id, name=run.name, state=run.state, message=run.message,
                      rounds_done=run.rounds_done, rounds_total=run.rounds_total,
                      sites=list(run.sites), run_dir=run.run_dir, rounds=rounds)
