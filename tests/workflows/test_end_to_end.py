"""The quickstart through `xffl submit`: StreamFlow, torchrun DDP, FedAvg, registry. (A failing
site fails the run with exit 1: tests/workflows/test_failure_policy.py.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.conftest import QUICKSTART, FinishedRun
from xffl.aggregator.exchange import verify_checkpoint
from xffl.aggregator.shards import MODEL_FILE
from xffl.cli.app import app
from xffl.training.trainer import evaluate

runner = CliRunner()


@pytest.mark.slow
def test_quickstart_end_to_end(quickstart_run: FinishedRun,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's quickstart job as it is: 3 rounds, 2 sites, 2 DDP ranks each."""
    xffl_home = quickstart_run.home
    monkeypatch.setenv("XFFL_HOME", str(xffl_home))
    spec = yaml.safe_load(QUICKSTART.read_text())
    rounds = spec["rounds"]
    samples = {s["name"]: s["data"]["synthetic_sequences"] for s in spec["sites"]}
    status = quickstart_run.status
    assert status["state"] == "completed" and status["rounds_done"] == rounds == 3
    run_dir = quickstart_run.run_dir
    assert run_dir.parent == xffl_home / "runs"

    previous = verify_checkpoint(run_dir / "rounds" / "0" / "global")
    for rnd in range(1, rounds + 1):
        round_dir = run_dir / "rounds" / str(rnd)
        glob = verify_checkpoint(round_dir / "global")  # checksums + tensor index
        assert glob.kind == "global" and glob.round == rnd
        assert glob.parent == previous.digest()
        updates = {s: verify_checkpoint(round_dir / "updates" / s) for s in samples}
        assert {s: u.num_samples for s, u in updates.items()} == samples
        assert all(u.parent == previous.digest() and u.round == rnd for u in updates.values())
        # the global is the sample-weighted average, recomputed here from the files
        weights = {s: float(u.num_samples) for s, u in updates.items()}
        tensors = {s: load_file(str(round_dir / "updates" / s / MODEL_FILE)) for s in updates}
        result_tensors = load_file(str(round_dir / "global" / MODEL_FILE))
        assert set(result_tensors) == set(tensors["alpha"])
        for name, got in result_tensors.items():
            expected = sum(weights[s] * tensors[s][name].astype(np.float64) for s in updates)
            expected /= sum(weights.values())
            # The aggregator computes the same float64 average (2 products, 1 sum, 1 division:
            # each within 4 * 2^-53 * max|x_i| of the exact one, so <= 8 * 2^-53 * max|x_i|
            # apart) and rounds it once to fp32 (<= 2^-24 relative): rtol 2^-23, atol
            # 16 * 2^-53 * max|x_i|. Sites weighed equally instead (768 vs 512 samples) move
            # the average by ~1e-4, far above the ~1e-7 this allows.
            xmax = max(float(np.abs(tensors[s][name]).max()) for s in updates)
            np.testing.assert_allclose(got, expected, rtol=2**-23, atol=16 * 2**-53 * xmax,
                                       err_msg=name)
        previous = glob

    # every round's global model is better on each site's private data than the previous
    # one, and so is its average over both sites
    curves = {site: [evaluate(run_dir / "rounds" / str(r) / "global",
                              xffl_home / "sites" / site / "data" / site,
                              seq_len=spec["training"]["seq_len"], max_batches=8)
                     for r in range(rounds + 1)] for site in samples}
    for site, curve in curves.items():
        assert all(b < a for a, b in itertools.pairwise(curve)), (site, curve)
    mean = [sum(c[r] for c in curves.values()) / len(curves) for r in range(rounds + 1)]
    assert all(b < a for a, b in itertools.pairwise(mean)), mean
    assert mean[-1] < mean[0] - 1.0, mean

    # the registry's view, through the CLI
    shown = runner.invoke(app, ["status", status["run_id"], "--json"])
    assert shown.exit_code == 0
    shown_rounds = json.loads(shown.stdout)["rounds"]
    assert [r["round"] for r in shown_rounds] == [1, 2, 3]
    for r in shown_rounds:
        assert r["state"] == "completed"
        by_site = {s["site"]: s for s in r["sites"]}
        assert {k: v["num_samples"] for k, v in by_site.items()} == samples
        assert all(s["loss"] is not None and s["loss"] > 0 for s in by_site.values())
    table = runner.invoke(app, ["status", status["run_id"]], env={"COLUMNS": "200"})
    assert "completed" in table.stdout and "global" in table.stdout


@pytest.mark.slow
def test_export_writes_the_global_for_transformers(quickstart_run: FinishedRun,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """`xffl export` of the quickstart: the last global's tensors and config, no manifest,
    which transformers loads; --merge is refused for a whole-model run."""
    import transformers

    from tests.cli.schemas import check

    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", quickstart_run.run_id, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = check("export", json.loads(result.stdout))
    assert (data["round"], data["merged"], data["files"]) == (
        3, False, ["config.json", "model.safetensors"])
    final = load_file(str(quickstart_run.run_dir / "rounds" / "3" / "global" / MODEL_FILE))
    model = transformers.LlamaForCausalLM.from_pretrained(str(out))
    state = model.state_dict()
    assert all(np.array_equal(state[k].numpy(), v) for k, v in final.items())
    again = runner.invoke(app, ["export", "last", "-o", str(out)])
    assert again.exit_code == 2 and "--force" in again.stderr
    merged = runner.invoke(app, ["export", "last", "--merge", "-o", str(tmp_path / "m")])
    assert merged.exit_code == 2 and "this run trains the whole model" in merged.stderr
    assert not (tmp_path / "m").exists()
