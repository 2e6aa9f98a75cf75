"""A real 2-round, 2-site job through `xffl submit`: StreamFlow, torchrun DDP, FedAvg, registry."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.aggregator.exchange import MODEL_FILE, verify_checkpoint
from xffl.cli.app import app
from xffl.training.trainer import evaluate

runner = CliRunner()


def _job(tmp_path: Path, name: str, rounds: int, steps: int) -> dict:
    """The quickstart spec, renamed and shortened for a test."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["name"] = name
    spec["rounds"] = rounds
    spec["training"]["steps"] = steps
    return spec


def _submit_wait(tmp_path: Path, spec: dict) -> tuple[int, dict]:
    """Write ``spec``, run `xffl submit --wait --json` on it, return exit code and status."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300"])
    return result.exit_code, (json.loads(result.stdout) if result.stdout.strip() else {})


@pytest.mark.slow
def test_two_round_job_end_to_end(tmp_path: Path, xffl_home: Path) -> None:
    spec = _job(tmp_path, "e2e", rounds=2, steps=12)
    spec["sites"][0]["data"]["synthetic_sequences"] = 300
    spec["sites"][1]["data"]["synthetic_sequences"] = 180
    code, status = _submit_wait(tmp_path, spec)
    assert code == 0, status
    assert status["state"] == "completed" and status["rounds_done"] == 2
    run_dir = Path(status["run_dir"])
    assert run_dir.parent == xffl_home / "runs"

    previous = verify_checkpoint(run_dir / "rounds" / "0" / "global")
    for rnd in (1, 2):
        round_dir = run_dir / "rounds" / str(rnd)
        glob = verify_checkpoint(round_dir / "global")  # checksums + tensor index
        assert glob.kind == "global" and glob.round == rnd
        assert glob.parent == previous.digest()
        updates = {s: verify_checkpoint(round_dir / "updates" / s) for s in ("alpha", "beta")}
        assert {u.num_samples for u in updates.values()} == {300, 180}
        assert all(u.parent == previous.digest() and u.round == rnd for u in updates.values())
        # the global is the sample-weighted average, recomputed here from the files
        weights = {s: float(u.num_samples) for s, u in updates.items()}
        tensors = {s: load_file(str(round_dir / "updates" / s / MODEL_FILE)) for s in updates}
        result_tensors = load_file(str(round_dir / "global" / MODEL_FILE))
        assert set(result_tensors) == set(tensors["alpha"])
        for name, got in result_tensors.items():
            expected = sum(weights[s] * tensors[s][name].astype(np.float64) for s in updates)
            expected /= sum(weights.values())
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=name)
        previous = glob

    # the federated model got better on every site's private data
    final = run_dir / "rounds" / "2" / "global"
    initial = run_dir / "rounds" / "0" / "global"
    for site in ("alpha", "beta"):
        data = xffl_home / "sites" / site / "data" / site
        before = evaluate(initial, data, seq_len=64, max_batches=8)
        after = evaluate(final, data, seq_len=64, max_batches=8)
        assert after < before - 0.5, (site, before, after)

    # the registry's view, through the CLI
    shown = runner.invoke(app, ["status", status["id"], "--json"])
    assert shown.exit_code == 0
    rounds = json.loads(shown.stdout)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["state"] == "completed"
        by_site = {s["site"]: s for s in r["sites"]}
        assert by_site["alpha"]["num_samples"] == 300 and by_site["beta"]["num_samples"] == 180
        assert all(s["loss"] is not None and s["loss"] > 0 for s in by_site.values())
    table = runner.invoke(app, ["status", status["id"]], env={"COLUMNS": "200"})
    assert "completed" in table.stdout and "global" in table.stdout


@pytest.mark.slow
def test_failing_site_fails_the_run_with_exit_1(tmp_path: Path, xffl_home: Path) -> None:
    spec = _job(tmp_path, "broken", rounds=1, steps=2)
    spec["sites"][1]["data"] = {"path": str(tmp_path / "no-such-data")}  # no shards, no synthetic
    code, status = _submit_wait(tmp_path, spec)
    assert code == 1, status
    assert status["state"] == "failed"
    assert status["rounds_done"] == 0
    assert "step /rounds/train_beta failed" in status["message"]
    sites = {s["site"]: s for s in status["rounds"][0]["sites"]}
    assert sites["beta"]["state"] == "failed" and "training job failed" in sites["beta"]["reason"]
    assert sites["alpha"]["state"] == "aborted"
    assert not (Path(status["run_dir"]) / "rounds" / "1" / "global").exists()
