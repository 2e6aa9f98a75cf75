"""The quickstart through `xffl submit`: StreamFlow, torchrun DDP, FedAvg, registry. (A failing
site fails the run with exit 1: tests/workflows/test_failure_policy.py.)"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
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
    # each site trains on its corpus less the tenth it holds out (ceil(0.1 n) sequences)
    samples = {s["name"]: s["data"]["synthetic_sequences"]
               - math.ceil(s["data"]["validation"]["fraction"] * s["data"]["synthetic_sequences"])
               for s in spec["sites"]}
    assert samples == {"alpha": 768 - 77, "beta": 512 - 52}
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
            # 16 * 2^-53 * max|x_i| (<= 1.5e-7 here). Sites weighed equally instead (691 vs
            # 460 samples) move the average by up to 7e-3 to 1.7e-2 a round (measured).
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
        for site, shown_site in by_site.items():
            _check_hardware(shown_site, run_dir / "rounds" / str(r["round"]) / "updates" / site)
    table = runner.invoke(app, ["status", status["run_id"]], env={"COLUMNS": "200"})
    assert "completed" in table.stdout and "global" in table.stdout
    # not a terminal: a line on the run, a header, tab-separated rows, then lines on the run
    header, *rows = [line for line in table.stdout.splitlines() if "\t" in line]
    columns = header.split("\t")
    device, mfu = columns.index("device"), columns.index("MFU")
    sites = [row.split("\t") for row in rows if row.split("\t")[1] in samples]
    assert len(sites) == 2 * rounds and all(s[device] == "cpu" and s[mfu] == "-" for s in sites)
    assert all(float(s[columns.index("tok/s per GPU")]) > 0 for s in sites)


def _check_hardware(shown: dict[str, object], update: Path) -> None:
    """A site's round in `xffl status --json`: trained on the CPU (0 GPUs, no MFU without a
    declared peak), its tokens/s per rank and TFLOP/s as its update's manifest says, the
    TFLOP/s being torchtitan's FLOPs per token of the model times the tokens/s."""
    import transformers

    from xffl.training.checkpoint import read_config
    from xffl.training.telemetry import flop_params, flops_per_token

    manifest = verify_checkpoint(update)
    assert (shown["device"], shown["gpus"], shown["mfu"]) == ("cpu", 0, None)
    assert (manifest.extra["device"], manifest.extra["gpus"]) == ("cpu", 0)
    rate = manifest.metrics["tokens_per_s_per_gpu"]
    assert shown["tokens_per_s_per_gpu"] == rate and rate > 0
    config = read_config(update)
    model = transformers.AutoModelForCausalLM.from_config(config.hf)
    per_token = flops_per_token(flop_params(model), config.num_hidden_layers,
                                config.num_attention_heads, config.head_dim,
                                manifest.extra["seq_len"])
    # the same float products in the same order: equal to the last bit but for rounding
    assert shown["tflops"] == pytest.approx(per_token * rate / 1e12, rel=1e-12)
    # the larger peak RSS of the site's two ranks: each holds torch and the small model
    peak = shown["peak_memory_gib"]
    assert isinstance(peak, float) and 0.1 < peak < 8, peak
    assert "save_s" in shown  # reported by the streamed save; absent before it: None


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


def held_out_windows(n: int, fraction: float) -> np.ndarray:
    """The documented split, written out again: the first ceil(f n) windows of the
    permutation numpy draws from [sha256("xffl-validation")[:8] as an integer, n]."""
    salt = int.from_bytes(hashlib.sha256(b"xffl-validation").digest()[:8], "big")
    k = math.ceil(round(fraction * n, 9))
    return np.sort(np.random.default_rng([salt, n]).permutation(n)[:k])


@pytest.mark.slow
def test_federated_validation_every_round(quickstart_run: FinishedRun,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every completed round of the quickstart has each site's validation loss of the
    incoming global (and of its own update) and the federated one; one site's number is
    computed again here by transformers, in float64, on the held-out windows."""
    import torch
    import transformers

    monkeypatch.setenv("XFFL_HOME", str(quickstart_run.home))
    spec = yaml.safe_load(QUICKSTART.read_text())
    shown = runner.invoke(app, ["status", quickstart_run.run_id, "--json"])
    assert shown.exit_code == 0, shown.output
    rounds = json.loads(shown.stdout)["rounds"]
    held_out = {s["name"]: len(held_out_windows(s["data"]["synthetic_sequences"],
                                                s["data"]["validation"]["fraction"]))
                for s in spec["sites"]}
    assert held_out == {"alpha": 77, "beta": 52}  # all of them: under the 16 x 8 budget
    seq_len = spec["training"]["seq_len"]
    for rnd in rounds:
        assert rnd["state"] == "completed"
        sites = {s["site"]: s for s in rnd["sites"]}
        for name, site in sites.items():
            assert site["val_samples"] == held_out[name]
            # text data: every target of every held-out window is in the loss
            assert site["val_tokens"] == held_out[name] * seq_len
            assert site["val_loss_update"] > 0 and 0 < site["val_loss"] < math.log(256) + 0.5
        # the mean over all the sites' held-out targets: each site's mean weighted by its
        # targets; math.fsum is correctly rounded whatever the order, and the division
        # rounds once, so the same inputs give the same float64, bit for bit
        total = sum(s["val_tokens"] for s in sites.values())
        assert (rnd["val_tokens"], rnd["val_samples"]) == (total, sum(held_out.values()))
        assert rnd["val_loss"] == math.fsum(s["val_loss"] * s["val_tokens"]
                                            for s in sites.values()) / total
        # for text data that is the sequence-weighted mean of before, bit for bit: every
        # token count is 64 = 2^6 times the sequence count, an exact scaling in float64
        assert rnd["val_loss"] == math.fsum(s["val_loss"] * s["val_samples"]
                                            for s in sites.values()) / rnd["val_samples"]
        # and what the run directory holds (the early stop reads it)
        on_disk = json.loads((quickstart_run.run_dir / "rounds" / str(rnd["round"])
                              / "validation.json").read_text())
        assert on_disk["val_loss"] == rnd["val_loss"]
        assert on_disk["site_tokens"] == {n: s["val_tokens"] for n, s in sites.items()}
    # round 2 started from round 1's global: its validation loss at alpha, again
    data_dir = quickstart_run.home / "sites" / "alpha" / "data" / "alpha"
    tokens = np.fromfile(data_dir / "train.bin", dtype=np.uint16).astype(np.int64)
    n = len(tokens) // (seq_len + 1)
    windows = held_out_windows(n, 0.1)
    rows = torch.from_numpy(np.stack([tokens[w * (seq_len + 1):(w + 1) * (seq_len + 1)]
                                      for w in windows]))
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(quickstart_run.run_dir / "rounds" / "1" / "global"), torch_dtype=torch.float64)
    sums: list[float] = []  # S_z = max over tokens and logits j of sum_k |h_k W_jk|
    hook = model.lm_head.register_forward_hook(lambda mod, args, _out: sums.append(float(
        (args[0].abs() @ mod.weight.abs().T).max())))
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    hook.remove()
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
    got = next(s for s in rounds[1]["sites"] if s["site"] == "alpha")["val_loss"]
    # xffl evaluated in fp32 (u = 2^-24) on 2 DDP ranks (38 + 39 windows), summing token
    # losses in float64; this reference is float64 (its own error < 1e-12). Rounding errors,
    # first order, with the layer gains ~1 of tests/training/test_parallelize.py: a token's
    # logits pass through N <= 2048 rounded terms per layer chain (per layer: q, k, v, o,
    # gate and up projections of 64 terms, down of 172, 2 RMS norms of 64 squares, scores of
    # 16, softmax and value sums of <= 64 positions: 828; 2 layers, the final norm, the
    # head's 64 terms and the log-softmax over 256 logits), each rounding delta_i (|delta_i|
    # <= u) entering with a coefficient <= S_z = max_j sum_k |h_k W_jk| (measured: 3.7), and
    # the token's loss moves by at most twice that (log-softmax is 1-Lipschitz in each logit,
    # the target logit enters once more). The validation loss is the mean over T = 77 x 64
    # tokens: its error sum_i c_i delta_i has sum_i |c_i| <= 2 N S_z, and |c_i| <= 64 x 2 S_z
    # / T (a key or value rounding reaches at most the 64 tokens of its window), so
    # sum_i c_i^2 <= 256 N S_z^2 / T. The worst case (2 N u S_z = 9e-4) is far from what
    # rounding does: as independent mean-zero errors (Higham & Mary, SIAM J. Sci. Comput.
    # 41(5), 2019), Hoeffding's inequality bounds the error by lambda u sqrt(sum c_i^2) but
    # with probability <= 2 exp(-lambda^2 / 2): lambda = 8 (2.5e-14) gives
    # 8 u S_z sqrt(256 N / T) = 1.8e-5 (measured: 5e-8). A wrong split (other windows) is off
    # by > 3e-3, a loss over rank 0's share only by > 1e-2, and moving any one held-out
    # window to the next training window by 4.3e-5 to 2.7e-3 (measured on this run).
    (s_z,) = sums
    tokens_evaluated = rows.shape[0] * seq_len
    assert rows.shape[0] == 77 and s_z <= 4, s_z
    bound = 8 * 2.0**-24 * s_z * math.sqrt(256 * 2048 / tokens_evaluated)
    assert bound < 2e-5
    assert abs(got - expected) <= bound, (got, expected, bound)
