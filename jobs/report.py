"""The numbers of `xffl report` and `xffl status`: loss, round-time breakdown and throughput.

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

The round's aggregation follows. The report itself (PNG plots and one HTML page) is drawn by
:mod:`xffl.jobs.report_render` and written atomically by
:func:`xffl.jobs.report_write.write_report`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xffl.jobs.profiles_json import slurm_site_names
from xffl.jobs.records import EvalCell, RoundRecord, RunRecord, SiteRound, Transfer
from xffl.jobs.registry import Registry

REPORT_FILES = ("validation.png", "cross-site.png", "loss.png", "breakdown.png",
                "throughput.png", "report.html")
# how the table (HTML and `xffl status`) prints each number; "-" when it is not known
FORMATS = {"num_samples": "{}", "num_tokens": "{}", "loss": "{:.4f}", "val_loss": "{:.4f}",
           "val_loss_update": "{:.4f}", "train_s": "{:.1f}",
           "queue_wait_s": "{:.1f}", "startup_s": "{:.1f}", "transfer_s": "{:.1f}",
           "other_s": "{:.1f}", "aggregate_s": "{:.2f}", "tokens_per_s": "{:.0f}",
           "delivered_s": "{:.1f}"}


GLOBAL = "global"  # the global model's column (xffl.workflows.plan.evaluation names it so)


def cross_site_matrix(cells: list[EvalCell]) -> dict[str, Any]:
    """The latest round's matrix: ``{"round", "sites", "models", "losses"}`` (rows = data
    sites, columns = models, None where a cell is missing); round None when there is none."""
    if not cells:
        return {"round": None, "sites": [], "models": [], "losses": []}
    rnd = max(c.round for c in cells)
    latest = [c for c in cells if c.round == rnd]
    sites = sorted({c.data_site for c in latest})
    others = sorted({c.model for c in latest} - {GLOBAL})
    models = ([GLOBAL] if any(c.model == GLOBAL for c in latest) else []) + others
    loss = {(c.data_site, c.model): float(c.loss) for c in latest}
    return {"round": rnd, "sites": sites, "models": models,
            "losses": [[loss.get((s, m)) for m in models] for s in sites]}



def fmt(key: str, value: float | int | None) -> str:
    """``value`` as the report's table prints the column ``key`` (``-`` when unknown)."""
    return "-" if value is None else FORMATS[key].format(value)


def megabytes(value: int | None) -> str:
    """Bytes as the tables print them: MB (10^6 bytes) with 2 decimals, ``-`` unknown."""
    return "-" if value is None else f"{value / 1e6:.2f}"


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


@dataclass
class TransferTimes:
    """The recorded transfers of a run, attributed to the round during which each started."""

    spans: dict[tuple[int, str], list[tuple[float, float]]] = field(default_factory=dict)
    moved: dict[tuple[int, str, str], int] = field(default_factory=dict)  # bytes by direction
    timed: bool = False  # whether the run recorded any transfer at all

    @classmethod
    def of(cls, transfers: list[Transfer], rounds: list[RoundRecord]) -> TransferTimes:
        """Rounds run one after the other: round r owns what started before round r+1."""
        starts = sorted((r.started, r.round) for r in rounds if r.started is not None)
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        moved: dict[tuple[int, str, str], int] = {}
        for t in transfers:
            owner = None
            for started, rnd in starts:
                if started <= t.started:
                    owner = rnd
            if owner is not None:
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
    startup_s: float | None
    train_s: float | None
    transfer_s: float | None
    other_s: float | None
    delivered_s: float | None
    tokens_per_s: float | None
    received_bytes: int | None
    sent_bytes: int | None
    val_loss: float | None = None  # of the global model the round started from
    val_loss_update: float | None = None  # of the site's own update
    val_samples: int | None = None


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
    val_loss: float | None = None  # federated, of the global model the round started from
    val_samples: int | None = None


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
    # the latest cross-site evaluation (`xffl evaluate`): round, sites (rows: held-out data),
    # models (columns: global, each site's update), losses
    cross_site: dict[str, Any] = field(default_factory=lambda: cross_site_matrix([]))

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
    records = registry.rounds(run.id)
    parts = breakdowns(registry, run, records)
    rounds = []
    for rnd in records:
        rows = []
        for s in rnd.sites:
            b = parts[(rnd.round, s.site)]
            rows.append(SiteRow(site=s.site, state=s.state, num_samples=s.num_samples,
                                num_tokens=s.num_tokens, loss=s.loss, attempts=s.attempts,
                                reason=s.reason, **asdict(b), val_loss=s.val_loss,
                                val_loss_update=s.val_loss_update, val_samples=s.val_samples))
        wall = (rnd.ended - rnd.started
                if rnd.ended is not None and rnd.started is not None else None)
        rounds.append(RoundRow(round=rnd.round, state=rnd.state, num_samples=rnd.num_samples,
                               loss=rnd.loss, aggregate_s=rnd.aggregate_seconds, wall_s=wall,
                               sites=rows, val_loss=rnd.val_loss, val_samples=rnd.val_samples))
    return ReportData(run_id=run.id, name=run.name, state=run.state, message=run.message,
                      rounds_done=run.rounds_done, rounds_total=run.rounds_total,
                      sites=list(run.sites), run_dir=run.run_dir, rounds=rounds,
                      cross_site=cross_site_matrix(registry.evaluations(run.id)))
