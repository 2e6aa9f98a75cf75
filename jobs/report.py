"""The numbers of `xffl report` and `xffl status`: loss, round-time breakdown and throughput.

Every figure comes from the run registry; where each site's round went
(queue wait, start-up, training, transfer, other) is :mod:`xffl.jobs.report.breakdown`'s.

The round's aggregation follows. The report itself (PNG plots and one HTML page) is drawn by
:mod:`xffl.jobs.report.render` and written atomically by
:func:`xffl.jobs.report.write.write_report`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xffl.jobs.registry.records import EvalCell, RunRecord
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.breakdown import rounds_broken_down

REPORT_FILES = ("validation.png", "cross-site.png", "loss.png", "breakdown.png",
                "throughput.png", "report.html")
# how the table (HTML and `xffl status`) prints each number; "-" when it is not known
FORMATS = {"num_samples": "{}", "num_tokens": "{}", "loss": "{:.4f}", "val_loss": "{:.4f}",
           "val_loss_update": "{:.4f}", "train_s": "{:.1f}",
           "queue_wait_s": "{:.1f}", "startup_s": "{:.1f}", "transfer_s": "{:.1f}",
           "other_s": "{:.1f}", "aggregate_s": "{:.2f}", "tokens_per_s": "{:.0f}",
           "delivered_s": "{:.1f}", "tokens_per_s_per_gpu": "{:.0f}", "tflops": "{:.4g}",
           "mfu": "{:.1%}", "peak_memory_gib": "{:.2f}", "save_s": "{:.1f}", "gpus": "{}",
           "device": "{}"}


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
    val_tokens: int | None = None  # the held-out targets in the loss: its federated weight
    # how its hardware ran the round (xffl.jobs.registry.records.SiteRound)
    device: str | None = None
    gpus: int | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    save_s: float | None = None


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
    val_tokens: int | None = None


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
    # the summary at the top: the model, each site with its ranks and profile, the seconds
    # from submit to the run's end (to now while it runs), and the final model's held-out
    # loss (xffl.jobs.registry.records.FinalLoss as a dict; None until measured)
    model: str = ""
    site_setup: list[str] = field(default_factory=list)
    wall_s: float | None = None
    final_loss: dict[str, Any] | None = None

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
    rounds = []
    for rnd, sites in rounds_broken_down(registry, run):
        rows = [SiteRow(site=s.site, state=s.state, num_samples=s.num_samples,
                        num_tokens=s.num_tokens, loss=s.loss, attempts=s.attempts,
                        reason=s.reason, **asdict(b), val_loss=s.val_loss,
                        val_loss_update=s.val_loss_update, val_samples=s.val_samples,
                        val_tokens=s.val_tokens, device=s.device, gpus=s.gpus,
                        tokens_per_s_per_gpu=s.tokens_per_s_per_gpu, tflops=s.tflops,
                        mfu=s.mfu, peak_memory_gib=s.peak_memory_gib,
                        save_s=s.save_seconds)
                for s, b in sites]
        wall = (rnd.ended - rnd.started
                if rnd.ended is not None and rnd.started is not None else None)
        rounds.append(RoundRow(round=rnd.round, state=rnd.state, num_samples=rnd.num_samples,
                               loss=rnd.loss, aggregate_s=rnd.aggregate_seconds, wall_s=wall,
                               sites=rows, val_loss=rnd.val_loss, val_samples=rnd.val_samples,
                               val_tokens=rnd.val_tokens))
    final = registry.final_loss(run.id)
    model, setup = describe_job(run)
    return ReportData(run_id=run.id, name=run.name, state=run.state, message=run.message,
                      rounds_done=run.rounds_done, rounds_total=run.rounds_total,
                      sites=list(run.sites), run_dir=run.run_dir, rounds=rounds,
                      cross_site=cross_site_matrix(registry.evaluations(run.id)),
                      model=model, site_setup=setup,
                      wall_s=(run.ended if run.ended is not None else time.time()) - run.created,
                      final_loss=None if final is None else asdict(final))


def describe_job(run: RunRecord) -> tuple[str, list[str]]:
    """The run's model and each site's set-up, in words, from its job file (``-`` and no
    sites when it cannot be read)."""
    from xffl.jobs.spec.schema import JobSpec

    try:
        spec = JobSpec.of_run(Path(run.run_dir))
    except Exception:  # a run dir moved or written by an older xffl: the summary says "-"
        return "-", []
    model = spec.model
    text = (f"{Path(model.init).name} (from {model.init})" if model.init is not None
            else f"preset {model.preset} (seeded weights)")
    if spec.training.lora is not None:
        text += f", LoRA adapter of rank {spec.training.lora.r}"
    setup = [f"{s.name} ({s.ranks} rank{'s' if s.ranks != 1 else ''}, profile {s.profile})"
             for s in spec.sites]
    return text, setup
