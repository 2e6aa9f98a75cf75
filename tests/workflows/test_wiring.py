"""The wiring between the plan and the aggregator, end to end through real `xffl submit` runs.

A non-default strategy with its own parameter, token weighting and a small shard size must
reach the aggregate step and give, round by round, the globals that FedAdam's formula gives
(recomputed here with numpy from the kept updates), while per-site budgets and throughput
balancing set each site's steps; an update that a real round rejects counts against
failure.min_sites. In the FedAdam run, site alpha sends its config.json with every integer
as a float (tests/security/json_equal_site.py): equal to the global's as JSON, so admitted,
but not loadable by transformers; every global's config must still be the coordinator's
bytes (alpha sorts first: were the first update's bytes used, beta could not load round 1's
global), beta trains round 2 and the export loads (issue 30). The FedAdam run is `xffl submit
--wait`'s (a supervisor runs the rounds' loop); the rejected update's one round runs in this
process as a cron tick runs it (`xffl round`). The local sites' ranks of both runs are
forked from one warm interpreter (tests/workflows/warm_ranks.py; alpha's profile keeps its
Python, which runs the launcher).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.conftest import QUICKSTART, REPO
from tests.security.json_equal_site import write_profile
from tests.workflows.warm_ranks import rank_python, warm_profile
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.cli.app import app
from xffl.workflows.steps.balance import balanced_steps

runner = CliRunner()

# FedAdam as Flower documents it (Reddi et al., 2021), written out here: with the weighted
# mean x_bar of the updates and the previous global x,
#   d = x_bar - x;  m = b1 m + (1 - b1) d;  v = b2 v + (1 - b2) d^2;
#   x' = x + eta m / (sqrt(v) + tau)
ETA, BETA_1, BETA_2, TAU = 0.05, 0.9, 0.99, 1e-9  # eta from the job spec; the rest Flower's


def _warm_sites(tmp_path: Path, spec: dict) -> None:
    """Every site of ``spec`` on a profile whose ranks the warm server forks: ``warm-local``,
    or the one it names already (in tmp_path/site_profiles) with that rank Python added."""
    profiles = tmp_path / "site_profiles"
    warm_profile(profiles)
    for site in spec["sites"]:
        if site.get("profile", "local") == "local":
            site["profile"] = "warm-local"
            continue
        path = profiles / f"{site['profile']}.yaml"
        profile = yaml.safe_load(path.read_text())
        profile.setdefault("env", {})["XFFL_RANK_PYTHON"] = str(rank_python())
        path.write_text(yaml.safe_dump(profile))


def _submit(tmp_path: Path, spec: dict, *flags: str) -> tuple[int, dict]:
    job = tmp_path / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300",
                                 *flags])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else {}


def _tick(tmp_path: Path, spec: dict, *flags: str) -> tuple[int, dict]:
    """Submit with --no-start, run the next round here (`xffl round`); its exit code and
    `xffl status --json` of the run."""
    job = tmp_path / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--json", *flags])
    assert submitted.exit_code == 0, submitted.output
    run_id = json.loads(submitted.stdout)["run_id"]
    ticked = runner.invoke(app, ["round", run_id, "--json"])
    shown = runner.invoke(app, ["status", run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    return ticked.exit_code, json.loads(shown.stdout)


def _widened(directory: Path) -> dict[str, np.ndarray]:
    """An update's bf16 tensors as float64, exactly (through torch's float32)."""
    from safetensors.torch import load_file as load_torch

    return {k: v.float().numpy().astype(np.float64)
            for k, v in load_torch(str(directory / "model.safetensors")).items()}


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, one file or Hugging Face shards (read independently)."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(str(directory / "model.safetensors"))
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(directory / shard)))
    return out


@pytest.mark.slow
def test_fedadam_tokens_shards_and_balance_reach_every_round(tmp_path: Path,
                                                            xffl_home: Path) -> None:
    """FedAdam over token-weighted updates into a sharded global, round by round; per-site
    budgets (alpha 4 steps, beta 2) and, from round 2, throughput balancing within them; the
    updates travel as bf16 deltas (exchange), decoded against each round's global."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="wired", rounds=2, exchange={"update": "delta", "dtype": "bf16"})
    spec["training"].update(steps=4, batch_size=4, balance="throughput", balance_max=1.5)
    spec["aggregation"] = {"strategy": "fedadam", "params": {"eta": ETA},
                           "weighting": "tokens", "max_shard_size": "100KB"}
    budgets = {"alpha": 4, "beta": 2}
    for site in spec["sites"]:
        site.update(ranks=1, budget={"steps": budgets[site["name"]]})  # different tokens
        site["data"]["synthetic_sequences"] = 64
    (tmp_path / "site_profiles").mkdir()
    spec["sites"][0]["profile"] = write_profile(tmp_path / "site_profiles")  # alpha: 2.0 for 2
    _warm_sites(tmp_path, spec)
    code, status = _submit(tmp_path, spec)
    assert code == 0, status
    run_dir = Path(status["run_dir"])
    own = (run_dir / "rounds" / "0" / "global" / "config.json").read_bytes()
    for rnd in (1, 2):  # alpha's floats were admitted; every global has the coordinator's bytes
        sent = (run_dir / "rounds" / str(rnd) / "updates" / "alpha" / "config.json").read_bytes()
        assert b'"num_hidden_layers": 2.0' in sent and json.loads(sent) == json.loads(own)
        assert (run_dir / "rounds" / str(rnd) / "global" / "config.json").read_bytes() == own
    # beta trained round 2 from round 1's global
    assert read_manifest(run_dir / "rounds" / "2" / "updates" / "beta").parent == \
        read_manifest(run_dir / "rounds" / "1" / "global").digest()
    for site in (s for r in status["rounds"] for s in r["sites"]):  # half the bytes come back
        assert site["sent_bytes"] < 0.55 * site["received_bytes"], site
    steps = {(r, s): verify_checkpoint(run_dir / "rounds" / str(r) / "updates" / s)
             .metrics["steps"] for r in (1, 2) for s in budgets}
    assert {s: steps[1, s] for s in budgets} == budgets  # round 1: the budgets as written
    # the balancing formula is pinned by tests/workflows/steps/test_balance.py; here, that what it
    # gives from the real round-1 measurements reached the round-2 job files and the trainer
    # obeyed them, within each site's bounds (its budget, at most balance_max times it)
    expected = balanced_steps(run_dir, 2, list(budgets))
    assert {s: steps[2, s] for s in budgets} == expected
    for site, budget in budgets.items():
        assert budget <= expected[site] <= math.floor(budget * 1.5)
        assert json.loads((run_dir / "rounds" / "2" / "jobs" / f"{site}.json").read_text())[
            "training"]["steps"] == expected[site]
    x = {k: v.astype(np.float64) for k, v in _tensors(run_dir / "rounds/0/global").items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v2 = {k: np.zeros_like(v) for k, v in x.items()}
    for rnd in (1, 2):
        rdir = run_dir / "rounds" / str(rnd)
        glob = verify_checkpoint(rdir / "global")
        assert (rdir / "global" / "model.safetensors.index.json").is_file()  # sharded
        assert len(glob.files) > 4 and glob.extra["aggregation"] == "fedadam"
        ups = {s: read_manifest(rdir / "updates" / s) for s in ("alpha", "beta")}
        assert all({t.dtype for t in u.tensors} == {"BF16"} for u in ups.values())  # deltas
        tokens = {s: float(u.num_tokens or 0) for s, u in ups.items()}
        # the steps times the same batch: the weights follow what each site trained
        assert tokens == {s: steps[rnd, s] * 4 * spec["training"]["seq_len"] for s in ups}
        got = _tensors(rdir / "global")
        deltas = {s: _widened(rdir / "updates" / s) for s in ups}
        new_x = {}
        for name, prev in x.items():
            # each site's weights: the global plus its bf16 change, rounded once to fp32
            mean = sum(tokens[s] * (prev + deltas[s][name]).astype(np.float32).astype(np.float64)
                       for s in ups) / sum(tokens.values())
            d = mean - prev
            m[name] = BETA_1 * m[name] + (1 - BETA_1) * d
            v2[name] = BETA_2 * v2[name] + (1 - BETA_2) * d * d
            ref = (prev + ETA * m[name] / (np.sqrt(v2[name]) + TAU)).astype(np.float32)
            # Both sides compute in float64 from the same fp32 inputs and round once to fp32.
            # Summation order can differ by ~1e-16 relative in d; the step's derivative in d
            # is at most (1 - b1) / tau = 1e8, so the float64 results differ by < 1e-8 * eta
            # * |x| < 1e-9, below half an fp32 ulp of these weights (> 1e-9 for |w| > 2e-2):
            # the fp32 results are equal, or one ulp apart where the value sits on a rounding
            # boundary.
            assert np.all(np.abs(got[name] - ref) <= np.spacing(np.abs(ref))), name
            new_x[name] = got[name].astype(np.float64)
            # the server state is kept as fp32 (server_m/server_v.safetensors)
            m[name] = m[name].astype(np.float32).astype(np.float64)
            v2[name] = v2[name].astype(np.float32).astype(np.float64)
        x = new_x

    # the final global, exported, is what transformers loads (its config: round 0's bytes)
    import torch
    import transformers

    result = runner.invoke(app, ["export", status["run_id"], "-o", str(tmp_path / "export")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "export" / "config.json").read_bytes() == own
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(32).reshape(2, 16)).logits
    assert logits.shape[:2] == (2, 16) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_an_update_rejected_in_a_real_round_counts_against_min_sites(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the sites import tests.workflows.update_fns
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    # one round of the smallest training that writes an update: what is under test is the
    # admission of beta's update and the round's verdict, not what the sites learn
    spec.update(name="rejected", rounds=1, model={"preset": "tiny-test"})
    spec["training"].update(steps=2, batch_size=2, seq_len=16,
                            update_fn="tests.workflows.update_fns:nan_at_beta")
    for site in spec["sites"]:
        site.update(ranks=1)
        site["data"]["synthetic_sequences"] = 32
        del site["data"]["validation"]  # no held-out evaluation in the round
    _warm_sites(tmp_path, spec)
    # its one round runs in this process, as a cron tick runs it (no supervisor of its own)
    code, status = _tick(tmp_path, spec, "--trust-entry-point")  # local sites import it
    assert code == 1 and status["state"] == "failed"
    (r1,) = status["rounds"]
    sites = {s["site"]: s for s in r1["sites"]}
    assert r1["state"] == "failed" and sites["alpha"]["state"] == "completed"
    assert sites["beta"]["state"] == "rejected"
    assert sites["beta"]["reason"] == \
        "tensor 'model.norm.weight' holds non-finite values (NaN or Inf)"
    assert "round 1: 1 valid update(s), the job needs 2 (failure.min_sites) (beta: tensor " \
        "'model.norm.weight' holds non-finite values (NaN or Inf))" in status["message"]
    assert not (Path(status["run_dir"]) / "rounds" / "1" / "global").exists()
