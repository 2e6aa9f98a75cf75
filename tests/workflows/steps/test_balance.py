"""Per-site budgets and throughput balancing: exact steps from last round's measured speed.

That the steps reach a real run's job files and trainers: tests/workflows/test_wiring.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xffl.jobs.spec.schema import SiteBudget
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.workflows.steps.balance import balanced_steps, round_job

runner = CliRunner()


def _run_dir(tmp_path: Path, speeds: dict[str, tuple[int, float]], **training: object) -> Path:
    """jobs/<site>.json (10 steps unless a budget says so) and round-1 update manifests."""
    root = tmp_path / "run"
    for site, (steps, seconds) in speeds.items():
        spec = TrainingSpec(steps=10, balance="throughput", **training)  # type: ignore[arg-type]
        job = TrainJob(run_id="r", site=site, model=ModelSpec(), training=spec,
                       data=DataSpec(path="d"))
        (root / "jobs").mkdir(parents=True, exist_ok=True)
        (root / "jobs" / f"{site}.json").write_text(job.model_dump_json())
        update = root / "rounds" / "1" / "updates" / site
        update.mkdir(parents=True)
        (update / "manifest.json").write_text(json.dumps(
            {"metrics": {"steps": float(steps), "train_seconds": seconds}}))
    return root


def test_fast_sites_get_more_steps_up_to_the_cap(tmp_path: Path) -> None:
    # fast: 1 s/step, slow: 4 s/step; the slow one needs 40 s for its 10 steps
    root = _run_dir(tmp_path, {"fast": (10, 10.0), "slow": (10, 40.0), "mid": (5, 12.5)})
    sites = ["fast", "mid", "slow"]
    assert balanced_steps(root, 2, sites) == {"fast": 40, "mid": 16, "slow": 10}
    assert balanced_steps(root, 1, sites) == {}  # round 1 runs the configured budgets
    path = round_job(root, "fast", 2, sites)
    assert path == "rounds/2/jobs/fast.json"
    job = TrainJob.model_validate_json((root / path).read_text())
    assert job.training.steps == 40 and job.training.tokens is None
    capped = _run_dir(tmp_path / "cap", {"fast": (10, 10.0), "slow": (10, 40.0)},
                      balance_max=2.5)
    assert balanced_steps(capped, 2, ["fast", "slow"]) == {"fast": 25, "slow": 10}


def test_sites_without_a_measurement_or_with_a_time_budget_keep_theirs(tmp_path: Path) -> None:
    root = _run_dir(tmp_path, {"a": (10, 10.0), "b": (10, 30.0)}, time_budget=60.0)
    assert balanced_steps(root, 2, ["a", "b"]) == {}
    assert round_job(root, "a", 2, ["a", "b"]) == "jobs/a.json"
    root = _run_dir(tmp_path / "2", {"a": (10, 10.0), "b": (10, 30.0)})
    (root / "rounds" / "1" / "updates" / "a" / "manifest.json").unlink()  # a missed round 1
    assert balanced_steps(root, 2, ["a", "b"]) == {"b": 10}


def test_site_budget_rules() -> None:
    base = TrainingSpec(steps=30, tokens=4096)
    assert SiteBudget(steps=5).apply(base).steps == 5
    assert SiteBudget(steps=5).apply(base).tokens is None
    assert SiteBudget(tokens=99).apply(base).tokens == 99
    assert SiteBudget(time=12.5).apply(base).time_budget == 12.5
    with pytest.raises(ValueError, match="give steps, tokens or time"):
        SiteBudget()
    with pytest.raises(ValueError, match="not both"):
        SiteBudget(steps=1, tokens=2)


@pytest.mark.parametrize("metrics", [
    {"steps": 10.0, "train_seconds": float("nan")},
    {"steps": 10.0, "train_seconds": float("inf")},
    {"steps": float("nan"), "train_seconds": 10.0},
    {"steps": 0.0, "train_seconds": 10.0},
    {"steps": -10.0, "train_seconds": -10.0},
    {"steps": "ten", "train_seconds": 10.0},
    {"steps": [10], "train_seconds": 10.0},
    {"steps": 10.0, "train_seconds": 1e-300},  # 1e-301 s/step: target / it overflows
])
def test_a_site_lying_about_its_speed_gets_no_crash_and_no_more_than_the_cap(
        tmp_path: Path, metrics: dict[str, object]) -> None:
    """A manifest's metrics are a site's word: NaN, inf, strings or absurd speeds (as
    Python's json writes and reads them) leave the site at its budget or at most the cap."""
    root = _run_dir(tmp_path, {"honest": (10, 40.0), "liar": (10, 10.0)})
    (root / "rounds" / "1" / "updates" / "liar" / "manifest.json").write_text(
        json.dumps({"metrics": metrics}))
    steps = balanced_steps(root, 2, ["honest", "liar"])
    assert steps["honest"] == 10
    # no measurement: the liar keeps its 10 steps; an absurd speed: balance_max caps it
    fast = metrics["train_seconds"] == 1e-300
    assert steps.get("liar", 10) == (math.floor(10 * TrainingSpec().balance_max) if fast else 10)
