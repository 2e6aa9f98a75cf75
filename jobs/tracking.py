"""Experiment tracking: each completed round's numbers, read from the registry, logged on the
coordinator to every tracker the job names (the sites need no credentials).

One class per backend behind one interface (:class:`Tracker`): TensorBoard event files
(``tracking_tensorboard``) and MLflow (``tracking_mlflow``). Their libraries are imported
only when a round is logged to them (``pip install xffl[tracking]``), never when this module
is imported: ``xffl status`` pays for neither.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xffl.aggregator.metrics import LOSS, VAL_LOSS, VAL_LOSS_UPDATE
from xffl.core.validation import PathText, check_path_text
from xffl.jobs.tracking.mlflow import MLflowTracker
from xffl.jobs.tracking.tensorboard import TensorBoardTracker
from xffl.jobs.tracking.tracker import Tracker

if TYPE_CHECKING:
    from xffl.jobs.registry.records import RoundRecord, RunRecord, Transfer

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_MLFLOW_RULE = ("write a folder for MLflow's file store (mlruns, /data/mlruns or "
                "file:/data/mlruns) or an http(s):// tracking server URL")


class TrackingSpec(BaseModel):
    """Where the coordinator logs every completed round: TensorBoard and/or MLflow."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: PathText | None = Field(
        default=None, description="folder on the coordinator for TensorBoard event files "
        "(relative: to the job file's folder); a run's go to <folder>/<run id>/")
    mlflow: str | None = Field(
        default=None, description="MLflow tracking URI: a folder or file:DIR (a file store, "
        "relative: to the job file's folder; file: alone is mlruns there) or an http(s):// "
        "tracking server (it gets the user's MLFLOW_TRACKING_* credentials only when the "
        "user configured that server outside the job: MLFLOW_TRACKING_URI, or "
        "mlflow_servers in ~/.config/xffl/tracking.yaml)")

    @field_validator("mlflow")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is not None:
            file_store_folder(value)
        return value


def file_store_folder(uri: str) -> str | None:
    """The folder of an MLflow file-store URI or path; None for an http(s) server."""
    check_path_text(uri)
    match = _SCHEME.match(uri)
    if match is None:
        if uri.split("/")[0] in ("databricks", "databricks-uc"):  # MLflow's, not a folder
            raise ValueError(f"mlflow: xffl does not log to Databricks ({uri!r}); write "
                             "./databricks for a folder of that name, or " + _MLFLOW_RULE)
        return uri
    scheme = match.group(1).lower()
    parts = urlsplit(uri)
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"mlflow: {uri!r} names no server; {_MLFLOW_RULE}")
        return None
    if scheme != "file":
        raise ValueError(f"mlflow: xffl does not log to {uri!r}; {_MLFLOW_RULE}")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"mlflow: {uri!r} names the host {parts.netloc!r}, but a file store "
                         "is a folder on the coordinator (file:/abs/path or file:rel/path); "
                         f"{_MLFLOW_RULE}")
    if parts.query or parts.fragment:
        raise ValueError(f"mlflow: {uri!r} holds '?' or '#'; {_MLFLOW_RULE}")
    return check_path_text(unquote(parts.path)) if parts.path else "mlruns"


def resolve(spec: TrackingSpec, base: Path) -> TrackingSpec:
    """``spec`` with absolute folders and URIs, relative ones taken from the folder ``base``."""
    update: dict[str, str] = {}
    if spec.tensorboard is not None:
        update["tensorboard"] = _absolute(spec.tensorboard, base)
    if spec.mlflow is not None:
        folder = file_store_folder(spec.mlflow)
        if folder is not None:
            update["mlflow"] = Path(_absolute(folder, base)).as_uri()
    return spec.model_copy(update=update)


def _absolute(path: str, base: Path) -> str:
    return os.path.abspath(Path(base) / Path(path).expanduser())


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
