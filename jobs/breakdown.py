"""Where a site's round went: queue wait, start-up, training, transfer and the rest.

Every figure comes from the run registry. A site's round is broken down as
``queue wait + start-up + training + transfer + other = delivered``:

- the queue wait is SLURM's (summed over the site's jobs of the round, retries included; 0 at
  a site without SLURM);
- start-up is the site's own measure from its launcher's start to the first training step
  (processes, imports, the process group, loading the global model and the data);
- training is the trainer's own loop time;
- transfer is what StreamFlow's copies between the coordinator and the site took (timed by
  :mod:`xffl.workflows.extensions.transfers`; copies overlapping in time count once);
- delivered is when the site's update was in place on the coordinator, counted from the
  round's start; ``other`` is what is left: StreamFlow's scheduling and polling, submitting
  the job, the batch script's own set-up, checking the update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from xffl.jobs.registry.profiles_json import slurm_site_names
from xffl.jobs.registry.records import RoundRecord, RunRecord, SiteRound, Transfer
from xffl.jobs.registry.store import Registry


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


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The time covered by the union of ``(start, end)`` spans (overlaps count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def round_starts(rounds: list[RoundRecord]) -> list[tuple[float, int]]:
    """(start time, round) of the rounds that started, in time order."""
    return sorted((r.started, r.round) for r in rounds if r.started is not None)


def owning_round(starts: list[tuple[float, int]], at: float) -> int | None:
    """The round during which ``at`` falls: the last of ``starts`` (:func:`round_starts`)
    that started at or before it (None: before the first round)."""
    owner = None
    for started, rnd in starts:
        if started <= at:
            owner = rnd
    return owner


@dataclass
class TransferTimes:
    """The recorded transfers of a run, attributed to the round during which each started."""

    spans: dict[tuple[int, str], list[tuple[float, float]]] = field(default_factory=dict)
    moved: dict[tuple[int, str, str], int] = field(default_factory=dict)  # bytes by direction
    timed: bool = False  # whether the run recorded any transfer at all

    @classmethod
    def of(cls, transfers: list[Transfer], rounds: list[RoundRecord]) -> TransferTimes:
        """Rounds run one after the other: round r owns what started before round r+1. What
        started after the last round ended is the final model's evaluation (the final global
        sent to each site, its numbers back), no round's."""
        starts = round_starts(rounds)
        last = max((r for r in rounds if r.started is not None), default=None,
                   key=lambda r: r.started or 0.0)
        over = last.ended if last is not None else None
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        moved: dict[tuple[int, str, str], int] = {}
        for t in transfers:
            owner = owning_round(starts, t.started)
            if owner is not None and (over is None or t.started <= over):
                spans.setdefault((owner, t.site), []).append((t.started, t.ended))
                key = (owner, t.site, t.direction)
                moved[key] = moved.get(key, 0) + (t.bytes or 0)
        return cls(spans, moved, bool(transfers))

    def get(self, rnd: int, site: str) -> float | None:
        """Seconds of transfer of ``site`` in round ``rnd``; None when the run timed none."""
        if not self.timed:
            return None
        return busy_seconds(self.spans.get((rnd, site), []))

    def bytes(self, rnd: int, site: str, direction: str) -> int | None:
        """Bytes moved to (``in``) or from (``out``) ``site`` in round ``rnd``; None when the
        run timed no transfer."""
        return self.moved.get((rnd, site, direction), 0) if self.timed else None


@dataclass
class Breakdown:
    """Where one site's round went, in seconds, and its training throughput."""

    queue_wait_s: float | None = None
    startup_s: float | None = None
    train_s: float | None = None
    transfer_s: float | None = None
    other_s: float | None = None
    delivered_s: float | None = None
    tokens_per_s: float | None = None
    received_bytes: int | None = None  # what the site was sent this round
    sent_bytes: int | None = None  # what came back from it


def site_breakdown(site: SiteRound, queue_wait_s: float | None,
                   transfer_s: float | None = None) -> Breakdown:
    """Split the site's delivery time into queue wait, start-up, training, transfer and other.

    ``other`` is what the delivery time leaves (never below 0), None when the delivery time
    is not known; a part that was not measured (a run that recorded no transfers, a site whose
    queue wait SLURM no longer knows) stays None and its time is in ``other``.
    """
    train, delivered, startup = site.train_seconds, site.delivered_seconds, site.startup_seconds
    parts = (queue_wait_s, startup, train, transfer_s)
    other = None
    if delivered is not None:
        other = max(0.0, delivered - sum(p for p in parts if p is not None))
    rate = None
    if site.num_tokens is not None and train:
        rate = site.num_tokens / train
    return Breakdown(queue_wait_s=queue_wait_s, startup_s=startup, train_s=train,
                     transfer_s=transfer_s, other_s=other, delivered_s=delivered,
                     tokens_per_s=rate)


def breakdowns(registry: Registry, run: RunRecord,
               rounds: list[RoundRecord]) -> dict[tuple[int, str], Breakdown]:
    """Every site's breakdown in every round of ``rounds``, by (round, site)."""
    waits = QueueWaits.of(registry, run)
    transfers = TransferTimes.of(registry.transfers(run.id), rounds)
    parts = {}
    for r in rounds:
        for s in r.sites:
            b = site_breakdown(s, waits.get(r.round, s.site), transfers.get(r.round, s.site))
            b.received_bytes = transfers.bytes(r.round, s.site, "in")
            b.sent_bytes = transfers.bytes(r.round, s.site, "out")
            parts[(r.round, s.site)] = b
    return parts


def rounds_broken_down(registry: Registry, run: RunRecord
                       ) -> list[tuple[RoundRecord, list[tuple[SiteRound, Breakdown]]]]:
    """The run's rounds as recorded, each site's round with its breakdown."""
    records = registry.rounds(run.id)
    parts = breakdowns(registry, run, records)
    return [(rnd, [(s, parts[(rnd.round, s.site)]) for s in rnd.sites]) for rnd in records]
