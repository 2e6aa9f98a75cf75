"""Experiment tracking: rounds from a real registry logged to real TensorBoard event files and
a real MLflow file store, read back with each tool's own reader."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xffl.jobs.registry.records import RoundRecord, RunRecord, SiteRound, Transfer
from xffl.jobs.registry.states import RoundState, RunState, SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.tracking import TrackingSpec, resolve
from xffl.jobs.tracking.mlflow import flatten_params
from xffl.jobs.tracking.rounds import log_round, round_scalars

# one worker imports MLflow (about 1 s) once for the whole module
pytestmark = pytest.mark.xdist_group("tracking")

T0 = 1_800_000_000.0
PARAMS: dict[str, Any] = {"rounds": 3, "training": {"lr": 0.001, "steps": 5},
                          "model": {"note": "x" * 900}}
# what each site's validation loss of the incoming global was, round by round (None: the
# round's global validation loss is not known in round 1: the sites evaluated nothing)
VAL = {"alpha": [None, 2.31, 2.07], "beta": [None, 2.44, 2.19]}


def _site(site: str, rnd: int) -> SiteRound:
    val = VAL[site][rnd - 1]
    return SiteRound(site=site, state=SiteState.COMPLETED, num_samples=100 * rnd, loss=3.1 / rnd,
                     train_seconds=4.5, delivered_seconds=6.25, val_loss=val,
                     val_loss_update=None if val is None else val - 0.1,
                     val_samples=None if val is None else 16)


def _round(rnd: int) -> RoundRecord:
    sites = [_site("alpha", rnd), _site("beta", rnd)]
    vals = [s.val_loss for s in sites if s.val_loss is not None]
    val = sum(vals) / len(vals) if vals else None  # the sites evaluated as many sequences
    return RoundRecord(round=rnd, state=RoundState.COMPLETED, started=T0 + 10 * rnd,
                       ended=T0 + 10 * rnd + 8, aggregate_seconds=0.75, num_samples=200 * rnd,
                       loss=3.0 / rnd, val_loss=val, val_samples=None if val is None else 32,
                       sites=sites)


@dataclass
class Logged:
    """A three-round run logged to both backends, and what log_round answered each round."""

    run: RunRecord
    spec: TrackingSpec
    rounds: list[RoundRecord]
    warnings: list[list[str]]


@pytest.fixture(scope="module")
def mlflow_module() -> Iterator[Any]:
    """MLflow, imported once, reading file stores (MLflow 3 refuses them unless told)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow
        yield mlflow


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Logged:
    """Three rounds recorded in a registry, then logged from it as the coordinator does."""
    base = tmp_path_factory.mktemp("tracking")
    registry = Registry(base / "registry.db")
    run_id = "demo-20270101-000000-abcd"
    registry.create_run(run_id, "demo", base / "job.yaml", base / "run", 3, ["alpha", "beta"])
    for rnd in (1, 2, 3):
        registry.start_round(run_id, rnd, ["alpha", "beta"])
        for site in ("alpha", "beta"):
            registry.record_transfer(run_id, site, "in", T0 + 10 * rnd + 1, T0 + 10 * rnd + 2,
                                     1000 * rnd)
            registry.record_transfer(run_id, site, "out", T0 + 10 * rnd + 6, T0 + 10 * rnd + 7,
                                     2000 * rnd)
        registry.finish_round(run_id, _round(rnd))
    spec = resolve(TrackingSpec(tensorboard="tb", mlflow="file:mlruns"), base)
    run = registry.get_run(run_id)
    rounds = registry.rounds(run_id)
    assert [r.sites[0].val_loss for r in rounds] == VAL["alpha"]  # the registry kept them
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        warnings = [log_round(spec, run, PARAMS, r, registry.transfers(run_id)) for r in rounds]
        assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set only while MLflow wrote
    return Logged(run, spec, rounds, warnings)


def _float32(value: float) -> float:
    return float(np.float32(value))


def _scalars(folder: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return acc


def test_tensorboard_has_one_scalar_per_round(logged: Logged) -> None:
    assert logged.warnings == [[], [], []]
    assert logged.spec.tensorboard is not None
    folder = Path(logged.spec.tensorboard) / logged.run.id
    assert len(list(folder.glob("events.out.tfevents.*"))) == 3
    assert not list(folder.glob(".*"))  # no partial file left behind
    acc = _scalars(folder)
    for site in ("alpha", "beta"):
        events = acc.Scalars(f"{site}/val_loss")
        assert [e.step for e in events] == [1, 2, 3][1:]  # round 1's None is not logged
        # TensorBoard stores a scalar as float32: compare with the value rounded to float32
        assert [e.value for e in events] == [_float32(v) for v in VAL[site][1:] if v]
        losses = acc.Scalars(f"{site}/loss")
        assert [(e.step, e.value) for e in losses] == [(r, _float32(3.1 / r)) for r in (1, 2, 3)]
        moved = [e.value for e in acc.Scalars(f"{site}/received_bytes")]
        assert moved == [1000.0, 2000.0, 3000.0]  # "in": sent to the site during the round
        assert [e.value for e in acc.Scalars(f"{site}/sent_bytes")] == [2000.0, 4000.0, 6000.0]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [
        (r.round, _float32(r.val_loss)) for r in logged.rounds[1:] if r.val_loss is not None]
    assert [e.value for e in acc.Scalars("round_s")] == [8.0, 8.0, 8.0]
    assert {"loss", "aggregate_s", "alpha/val_loss_update", "beta/train_s",
            "alpha/delivered_s", "beta/num_samples"} <= set(acc.Tags()["scalars"])


def test_tensorboard_repeated_round_replaces_the_earlier(tmp_path: Path) -> None:
    spec = TrackingSpec(tensorboard=str(tmp_path))
    run = RunRecord("r-1", "r", "job.yaml", "run", RunState.RUNNING, 3, 0, ["alpha"], 0.0, 0.0)
    stale = replace(_round(2), sites=[replace(_site("alpha", 2), val_loss=9.5)])
    for record in (_round(1), stale, _round(2), _round(3)):  # resumed: round 2 ran again
        assert log_round(spec, run, {}, record, []) == []
    events = _scalars(tmp_path / "r-1").Scalars("alpha/val_loss")
    assert [(e.step, e.value) for e in events] == [(2, _float32(2.31)), (3, _float32(2.07))]


def test_mlflow_one_run_with_every_round(logged: Logged, mlflow_module: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    uri = logged.spec.mlflow
    assert uri is not None and uri.startswith("file:///")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    runs = mlflow_module.search_runs(
        experiment_names=["demo"], output_format="list",
        filter_string=f"tags.`xffl.run_id` = '{logged.run.id}'")
    assert len(runs) == 1  # rounds 2 and 3 found the run round 1 made
    found = runs[0]
    assert found.info.run_name == logged.run.id
    assert found.info.status == "FINISHED"  # the last round ended it
    assert found.data.params["training.lr"] == "0.001"
    assert found.data.params["model.note"] == "x" * 500  # MLflow's length limit
    client = mlflow_module.tracking.MlflowClient(tracking_uri=uri)
    for site in ("alpha", "beta"):
        history = client.get_metric_history(found.info.run_id, f"{site}/loss")
        assert [(m.step, m.value) for m in history] == [(r, 3.1 / r) for r in (1, 2, 3)]
        history = client.get_metric_history(found.info.run_id, f"{site}/val_loss")
        assert [(m.step, m.value) for m in history] == [(2, VAL[site][1]), (3, VAL[site][2])]
    history = client.get_metric_history(found.info.run_id, "val_loss")
    assert [m.step for m in history] == [2, 3]


def test_failing_backend_warns_and_the_other_still_logs(
        tmp_path: Path, mlflow_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file where TensorBoard's folder should be")
    spec = resolve(TrackingSpec(tensorboard=str(blocker), mlflow="store"), tmp_path)
    run = RunRecord("r-2", "other", "job.yaml", "run", RunState.RUNNING, 5, 0, ["alpha"], 0.0,
                    0.0)
    warnings = log_round(spec, run, {"training": {"lr": 0.1}}, _round(1), [])
    assert len(warnings) == 1
    assert warnings[0].startswith("TensorBoard: round 1 was not logged to ")
    assert str(blocker) in warnings[0]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "store").as_uri())
    runs = mlflow_module.search_runs(experiment_names=["other"], output_format="list")
    assert [r.data.metrics["loss"] for r in runs] == [3.0]
    assert runs[0].info.status == "RUNNING"  # round 1 of 5


def test_importing_tracking_imports_no_backend() -> None:
    code = ("import sys, xffl.jobs.tracking.rounds; "
            "print(sorted({'mlflow', 'tensorboard', 'torch'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("uri", ["sqlite:///x.db", "s3://bucket/runs", "file://host/runs",
                                 "databricks", "http://", "runs\nx", ""])
def test_mlflow_uri_refused(uri: str) -> None:
    with pytest.raises(ValueError):
        TrackingSpec(mlflow=uri)


def test_resolve_relative_to_the_job_folder(tmp_path: Path) -> None:
    base = tmp_path / "job dir"
    plain = resolve(TrackingSpec(tensorboard="tb", mlflow="runs/ml"), base)
    assert plain.tensorboard == str(base / "tb")
    assert plain.mlflow == (base / "runs" / "ml").as_uri()
    assert resolve(plain, tmp_path) == plain  # already absolute
    assert resolve(TrackingSpec(mlflow="file:"), base).mlflow == (base / "mlruns").as_uri()
    assert resolve(TrackingSpec(mlflow="file:/srv/ml"), base).mlflow == "file:///srv/ml"
    server = "https://mlflow.example.org:5000"
    assert resolve(TrackingSpec(mlflow=server), base).mlflow == server
    with pytest.raises(ValueError):
        TrackingSpec(tensorboard=" ")
    with pytest.raises(ValueError):
        TrackingSpec.model_validate({"tensorboard": "tb", "wandb": "x"})


def test_scalars_and_params() -> None:
    record = _round(1)
    transfers = [Transfer("alpha", "in", T0 + 11, T0 + 12, 7),
                 Transfer("alpha", "in", T0 + 30, T0 + 31, 99)]  # a later round's
    scalars = round_scalars(record, transfers)
    assert scalars["alpha/received_bytes"] == 7.0 and scalars["beta/received_bytes"] == 0.0
    assert "val_loss" not in scalars and "alpha/val_loss" not in scalars
    assert "alpha/received_bytes" not in round_scalars(record, [])  # no copy was timed
    assert flatten_params({"a": {"b": {"c": 1}, "d": None}, "e f": [1, 2], "g:h": {}}) == {
        "a.b.c": "1", "a.d": "None", "e f": "[1, 2]", "g_h": "{}"}
