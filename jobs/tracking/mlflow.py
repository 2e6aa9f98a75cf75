"""MLflow as a tracker, and which tracking servers get the user's MLflow credentials.

A job spec is not trusted (collaborators pass them around), so a tracking server it names gets
none of the user's credentials: no ``MLFLOW_TRACKING_*`` variable (token, user name and
password, auth plugin, AWS SigV4, client certificate, TLS settings), no
``~/.mlflow/credentials`` and no ``~/.netrc``, unless the user configured that same server
outside the spec: ``MLFLOW_TRACKING_URI`` in the environment xffl runs in, or a line of
``mlflow_servers`` in ``tracking.yaml`` in the user's xffl config folder. The same server: the
same scheme, host, port and path. A user name and password the spec writes into its own URL
are the spec's, and go to that URL.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError

from xffl.core.paths import config_dir
from xffl.core.validation import StrictModel
from xffl.jobs.tracking.tracker import Tracker

if TYPE_CHECKING:
    from xffl.jobs.registry.records import RunRecord

_PARAM_KEY = re.compile(r"[^\w.\- /]")  # what MLflow refuses in a param's name
# MLflow's settings while xffl logs, unless the environment sets them: MLflow 3 refuses a file
# store without the first; a server that does not answer would hold the round for minutes with
# MLflow's 7 retries of a request that may wait 120 s each
_FILE_STORE_ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}
_SERVER_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
_DEFAULT_PORT = {"http": 80, "https": 443}


class UserTracking(StrictModel):
    """``tracking.yaml`` in the user's xffl config folder: the servers the user trusts."""

    mlflow_servers: list[str] = Field(
        default_factory=list, description="MLflow tracking servers (http(s) URLs) that get "
        "the user's MLFLOW_TRACKING_* credentials when a job spec names them")


def user_config_file() -> Path:
    """The user's tracking configuration: ``<xffl config folder>/tracking.yaml``."""
    return config_dir() / "tracking.yaml"


def user_servers() -> list[str]:
    """The MLflow servers the user configured outside any job spec: MLFLOW_TRACKING_URI, then
    ``mlflow_servers`` of :func:`user_config_file` (a ValueError naming it when malformed)."""
    servers = [os.environ.get("MLFLOW_TRACKING_URI", "")]
    path = user_config_file()
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
            servers += UserTracking.model_validate(loaded).mlflow_servers
        except (yaml.YAMLError, ValidationError, UnicodeDecodeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{path}: not a tracking configuration ({first}); write "
                             "mlflow_servers: [https://host:port]") from None
    return [s for s in servers if _origin(s) is not None]


def _origin(uri: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of an http(s) URL; None for anything else."""
    try:
        parts = urlsplit(uri.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORT or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORT[scheme], \
        parts.path.rstrip("/")


def gets_credentials(uri: str) -> bool:
    """Whether the MLflow server ``uri`` is one the user configured (:func:`user_servers`)."""
    origin = _origin(uri)
    return origin is not None and origin in {_origin(s) for s in user_servers()}


@contextmanager
def _environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``changes`` (None: unset) while the block runs."""
    saved = {key: os.environ.get(key) for key in changes}
    try:
        _set_environment(changes)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: Mapping[str, str | None]) -> None:
    """Set each variable of ``values`` in ``os.environ``; unset those whose value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def mlflow_env(uri: str) -> Iterator[None]:
    """MLflow's settings for ``uri`` while it logs: ``_FILE_STORE_ENV`` or ``_SERVER_ENV``
    where the environment sets none, and, for a server the user did not configure, none of
    the user's credentials (the variables unset, HOME and NETRC an empty folder's)."""
    is_file = uri.startswith("file:")
    wanted = _FILE_STORE_ENV if is_file else _SERVER_ENV
    changes: dict[str, str | None] = {k: v for k, v in wanted.items() if k not in os.environ}
    with ExitStack() as stack:
        if not is_file and not gets_credentials(uri):
            empty = stack.enter_context(tempfile.TemporaryDirectory(prefix="xffl-mlflow-"))
            changes.update({k: None for k in os.environ
                            if k.startswith("MLFLOW_TRACKING_") and k != "MLFLOW_TRACKING_URI"})
            changes.update(HOME=empty, NETRC=os.path.join(empty, "netrc"))
        stack.enter_context(_environment(changes))
        yield


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


class MLflowTracker(Tracker):
    """One MLflow run per xffl run (tagged ``xffl.run_id``), made on its first logged round."""

    backend = "MLflow"

    def warm_imports(self) -> None:
        """Import MLflow's client (about 3 CPU-seconds, once instead of in every round)."""
        import mlflow.entities
        import mlflow.exceptions
        import mlflow.tracking  # noqa: F401

    def log(self, run: RunRecord, params: dict[str, Any], step: int, wall_time: float,
            scalars: dict[str, float]) -> None:
        """Add the round's scalars (and, on a new MLflow run, the job's ``params``)."""
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        if "'" in run.id or "\\" in run.id:
            raise ValueError(f"run id {run.id!r} cannot be searched for in MLflow")
        millis = int(wall_time * 1000)
        with mlflow_env(self.target):
            client = MlflowClient(tracking_uri=self.target)
            experiment_id = _experiment(client, run.name)
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


def _experiment(client: Any, name: str) -> str:
    """The id of the experiment ``name``, made when missing (or meanwhile by another run)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return str(experiment.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:  # made meanwhile by another run of the same job
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)
