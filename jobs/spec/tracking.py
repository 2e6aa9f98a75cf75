"""The job spec's ``tracking`` section: where the coordinator logs every completed round."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import Field, field_validator

from xffl.core.validation import PathText, StrictModel, check_path_text

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_MLFLOW_RULE = ("write a folder for MLflow's file store (mlruns, /data/mlruns or "
                "file:/data/mlruns) or an http(s):// tracking server URL")


class TrackingSpec(StrictModel):
    """Where the coordinator logs every completed round: TensorBoard and/or MLflow."""

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
