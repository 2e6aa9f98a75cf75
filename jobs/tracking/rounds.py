"""Experiment tracking: each completed round's numbers, read from the registry, logged on the
coordinator to every tracker the job names (the sites need no credentials).

What the job names is its ``tracking`` section (:mod:`xffl.jobs.spec.tracking`).

One class per backend behind one interface (:class:`Tracker`): TensorBoard event files
(:mod:`xffl.jobs.tracking.tensorboard`) and MLflow (:mod:`xffl.jobs.tracking.mlflow`). Their
libraries are imported only when a round is logged to them (``pip install xffl[tracking]``),
never when this module is imported: ``xffl status`` pays for neither.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from xffl.aggregator.metrics import LOSS, VAL_LOSS, VAL_LOSS_UPDATE
from xffl.jobs.tracking.mlflow import MLflowTracker
from xffl.jobs.tracking.tensorboard import TensorBoardTracker
from xffl.jobs.tracking.tracker import Tracker

if TYPE_CHECKING:
    from xffl.jobs.registry.records import RoundRecord, RunRecord, Transfer
    from xffl.jobs.spec.tracking import TrackingSpec


def round_scalars(record: RoundRecord, transfers: list[Transfer]) -> dict[str, float]:
    """The numbers of one round by name: global ones plain, a site's as ``<site>/<name>``."""
    values: dict[str, float | int | None] = {
        LOSS: record.loss, VAL_LOSS: record.val_loss,
        "aggregate_s": record.aggregate_seconds, "num_samples": record.num_samples,
        "round_s": None if record.started is None or record.ended is None
        else record.ended - record.started,
    }
    start = record.started if record.started is not None else float("-inf")
    end = record.ended if record.ended is not None else float("inf")
    moved: dict[tuple[str, str], int] = {}
    for t in transfers:
        if start <= t.started <= end:
            moved[(t.site, t.direction)] = moved.get((t.site, t.direction), 0) + (t.bytes or 0)
    for s in record.sites:
        values.update({
            f"{s.site}/{LOSS}": s.loss, f"{s.site}/{VAL_LOSS}": s.val_loss,
            f"{s.site}/{VAL_LOSS_UPDATE}": s.val_loss_update, f"{s.site}/train_s": s.train_seconds,
            f"{s.site}/delivered_s": s.delivered_seconds, f"{s.site}/num_samples": s.num_samples,
        })
        if transfers:  # as the report: 0 for a site that moved nothing in a run that timed copies
            values[f"{s.site}/received_bytes"] = moved.get((s.site, "in"), 0)  # sent to it
            values[f"{s.site}/sent_bytes"] = moved.get((s.site, "out"), 0)  # back from it
    return {name: float(v) for name, v in values.items() if v is not None}


def trackers(spec: TrackingSpec) -> list[Tracker]:
    """The trackers ``spec`` names, TensorBoard first."""

    found: list[Tracker] = []
    if spec.tensorboard is not None:
        found.append(TensorBoardTracker(spec.tensorboard))
    if spec.mlflow is not None:
        found.append(MLflowTracker(spec.mlflow))
    return found


def warm_imports(spec: TrackingSpec) -> None:
    """Import the job's tracking backends' libraries (a process that forks the steps)."""
    for tracker in trackers(spec):
        tracker.warm_imports()


def log_round(spec: TrackingSpec, run: RunRecord, params: dict[str, Any], record: RoundRecord,
              transfers: list[Transfer]) -> list[str]:
    """Log one completed round to every configured backend; the warnings of those that failed."""
    scalars = round_scalars(record, transfers)
    wall_time = record.ended if record.ended is not None else time.time()
    warnings: list[str] = []
    for tracker in trackers(spec):
        try:
            tracker.log(run, params, record.round, wall_time, scalars)
        except Exception as exc:
            warnings.append(_warning(tracker, record.round, exc))
    return warnings


def _warning(tracker: Tracker, rnd: int, exc: Exception) -> str:
    hint = " (pip install 'xffl[tracking]')" if isinstance(exc, ImportError) else ""
    target = re.sub(r"//[^/@]*@", "//", tracker.target)  # no user:password of a server URL
    return (f"{tracker.backend}: round {rnd} was not logged to {target}: "
            f"{type(exc).__name__}: {exc}{hint}")
