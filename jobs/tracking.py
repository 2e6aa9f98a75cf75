"""Experiment tracking: each completed round's numbers, read from the registry, logged on the
coordinator to TensorBoard event files and to MLflow (the sites need no credentials).

TensorBoard and MLflow are imported only when a round is logged to them (``pip install
xffl[tracking]``), never when this module is imported: ``xffl status`` pays for neither.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from xffl.core.validation import check_path_text

if TYPE_CHECKING:
    from xffl.jobs.records import RoundRecord, RunRecord, Transfer

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_MLFLOW_RULE = ("write a folder for MLflow's file store (mlruns, /data/mlruns or "
                "file:/data/mlruns) or an http(s):// tracking server URL")
_PARAM_KEY = re.compile(r"[^\w.\- /]")  # what MLflow refuses in a param's name
# MLflow's settings while xffl logs, unless the environment sets them: MLflow 3 refuses a file
# store without the first; a server that does not answer would hold the round for minutes with
# MLflow's 7 retries of a request that may wait 120 s each
_FILE_STORE_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}
_SERVER_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class TrackingSpec(BaseModel):
    """Where the coordinator logs every completed round: TensorBoard and/or MLflow."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: str | None = Field(
        default=None, description="folder on the coordinator for TensorBoard event files "
        "(relative: to the job file's folder); a run's go to <folder>/<run id>/")
    mlflow: str | None = Field(
        default=None, description="MLflow tracking URI: a folder or file:FOLDER (a file store, "
        "relative: to the job file's folder; file: alone is mlruns there) or an http(s):// "
        "tracking server")

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_folder(cls, value: str | None) -> str | None:
        return None if value is None else check_path_text(value)

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
        "loss": record.loss, "val_loss": record.val_loss,
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
            f"{s.site}/loss": s.loss, f"{s.site}/val_loss": s.val_loss,
            f"{s.site}/val_loss_update": s.val_loss_update, f"{s.site}/train_s": s.train_seconds,
            f"{s.site}/delivered_s": s.delivered_seconds, f"{s.site}/num_samples": s.num_samples,
        })
        if transfers:  # as the report: 0 for a site that moved nothing in a run that timed copies
            values[f"{s.site}/received_bytes"] = moved.get((s.site, "in"), 0)  # sent to it
            values[f"{s.site}/sent_bytes"] = moved.get((s.site, "out"), 0)  # back from it
    return {name: float(v) for name, v in values.items() if v is not None}


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys (``training.lr``), values as text cut to 500 characters."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = _PARAM_KEY.sub("_", f"{prefix}{key}")[:250]
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, f"{name}."))
        else:
            flat[name] = str(value)[:500]
    return flat


def log_round(spec: TrackingSpec, run: RunRecord, params: dict[str, Any], record: RoundRecord,
              transfers: list[Transfer]) -> list[str]:
    """Log one completed round to every configured backend; the warnings of those that failed."""
    scalars = round_scalars(record, transfers)
    wall_time = record.ended if record.ended is not None else time.time()
    warnings: list[str] = []
    if spec.tensorboard is not None:
        try:
            _tensorboard(Path(spec.tensorboard) / run.id, record.round, wall_time, scalars)
        except Exception as exc:
            warnings.append(_warning("TensorBoard", spec.tensorboard, record.round, exc))
    if spec.mlflow is not None:
        try:
            _mlflow(spec.mlflow, run, params, record.round, wall_time, scalars)
        except Exception as exc:
            warnings.append(_warning("MLflow", spec.mlflow, record.round, exc))
    return warnings


def _warning(backend: str, target: str, rnd: int, exc: Exception) -> str:
    hint = " (pip install 'xffl[tracking]')" if isinstance(exc, ImportError) else ""
    target = re.sub(r"//[^/@]*@", "//", target)  # no user:password of a server URL
    return (f"{backend}: round {rnd} was not logged to {target}: "
            f"{type(exc).__name__}: {exc}{hint}")


def _tensorboard(folder: Path, step: int, wall_time: float, scalars: dict[str, float]) -> None:
    """Write one event file: a restart at ``step``, then the round's scalars.

    The SessionLog START makes TensorBoard drop what an earlier file logged at ``step`` and
    after (a resumed run that repeats a round), as torch's SummaryWriter(purge_step=) does.
    Event files are read in name order: the names start with the time in nanoseconds.
    """
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    folder.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    name = (f"events.out.tfevents.{now // 10**9:010d}.{now % 10**9:09d}."
            f"{socket.gethostname()}.{os.getpid()}")
    values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
    events = [Event(wall_time=wall_time, file_version="brain.Event:2"),
              Event(wall_time=wall_time, step=step,
                    session_log=SessionLog(status=SessionLog.START)),
              Event(wall_time=wall_time, step=step, summary=Summary(value=values))]
    partial = folder / f".xffl-{now}.partial"  # not "tfevents": TensorBoard never reads it
    with partial.open("wb") as out:
        writer = RecordWriter(out)
        for event in events:
            writer.write(event.SerializeToString())
    os.replace(partial, folder / name)


@contextmanager
def _mlflow_env(uri: str) -> Iterator[None]:
    """MLflow's settings for ``uri`` (``_FILE_STORE_ENV``, ``_SERVER_ENV``) while it logs."""
    wanted = _FILE_STORE_ENV if uri.startswith("file:") else _SERVER_ENV
    added = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _mlflow(uri: str, run: RunRecord, params: dict[str, Any], step: int, wall_time: float,
            scalars: dict[str, float]) -> None:
    """Add the round to the run's MLflow run (tagged xffl.run_id), made on the first round."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if "'" in run.id or "\\" in run.id:
        raise ValueError(f"run id {run.id!r} cannot be searched for in MLflow")
    millis = int(wall_time * 1000)
    with _mlflow_env(uri):
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(run.name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(run.name)
            except MlflowException:  # made meanwhile by another run of the same job
                experiment = client.get_experiment_by_name(run.name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        found = client.search_runs([experiment_id], max_results=1,
                                   filter_string=f"tags.`xffl.run_id` = '{run.id}'")
        if found:
            mlflow_id = found[0].info.run_id
        else:
            started = run.started if run.started is not None else run.created
            mlflow_id = client.create_run(experiment_id, start_time=int(started * 1000),
                                          tags={"xffl.run_id": run.id},
                                          run_name=run.id).info.run_id
            flat = [Param(k, v) for k, v in flatten_params(params).items()]
            for i in range(0, len(flat), 100):  # MLflow takes 100 params a batch
                client.log_batch(mlflow_id, params=flat[i:i + 100])
        metrics = [Metric(k, v, millis, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # and 1000 metrics
            client.log_batch(mlflow_id, metrics=metrics[i:i + 1000])
        if step >= run.rounds_total:
            client.set_terminated(mlflow_id, "FINISHED", end_time=millis)
