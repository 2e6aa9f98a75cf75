"""The LoRA checks of the two-facility SLURM run (tests/workflows/test_slurm_sites.py): the
frozen base sent once and untouched, only adapters exchanged, the globals as the sites'
sample-weighted means (the sites hold unequal data), freeze_a's exact products, and the
final adapter as transformers, peft and `xffl export --merge` read it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file
from typer.testing import CliRunner

from xffl.aggregator.adapter import adapted_modules, factor_names
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry
from xffl.training import lora
from xffl.training.checkpoint import load_model, read_weights
from xffl.training.config import LoraSpec

runner = CliRunner()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"r": 4, "alpha": 8, "target_modules": TARGETS}
SITES = ("alpha", "beta")
# two rounds: round 2 is already a later round (trained from an aggregated global, the
# base linked, not sent again); a third adds no path, only a site round's CPU per rank
ROUNDS = (1, 2)


def tensor_bytes(directory: Path) -> dict[str, bytes]:
    """Every tensor of a one-file model checkpoint, as raw bytes."""
    return {k: v.tobytes() for k, v in load_file(str(directory / "model.safetensors")).items()}


def base_sent_once(status: dict[str, Any], base0: Path, staged: dict[str, list[Path]]) -> None:
    """The frozen base crossed to each facility once (StreamFlow links its first copy in the
    later rounds: ``staged`` lists each facility's new ``base`` entries), and that copy and
    the run's own hold the init's tensors bit for bit after the rounds of training."""
    rounds = Path(status["run_dir"]) / "rounds"
    reference = tensor_bytes(base0)
    assert tensor_bytes(rounds / "0" / "base") == reference
    base_bytes = sum(f.stat().st_size for f in (rounds / "0" / "base").iterdir())
    for site in SITES:
        copies = [p for p in staged[site] if not p.is_symlink()]
        assert len(staged[site]) == len(ROUNDS) and len(copies) == 1, (site, staged)  # links
        assert all(p.resolve() == copies[0] for p in staged[site])
        assert tensor_bytes(copies[0]) == reference
        received = [t.bytes for t in Registry().transfers(status["run_id"])
                    if t.site == site and t.direction == "in"]
        assert sum(b is not None and b >= base_bytes for b in received) == 1, received
        rows = [s for r in status["rounds"] for s in r["sites"] if s["site"] == site]
        # the adapter (r = 4 on every linear of the tiny model) is a tenth of its base
        assert rows[0]["received_bytes"] > base_bytes > 5 * rows[1]["received_bytes"] > 0


def adapters_only(status: dict[str, Any]) -> None:
    """Only adapters came back and were aggregated; every site's loss and their weighted
    mean fell every round."""
    rounds = Path(status["run_dir"]) / "rounds"
    a0 = load_file(str(rounds / "0" / "global" / ADAPTER_FILE))
    for r in ROUNDS:
        for site in SITES:
            update = rounds / str(r) / "updates" / site
            assert sorted(p.name for p in update.iterdir()) == sorted(  # + SLURM's record
                [ADAPTER_FILE, ADAPTER_CONFIG_FILE, "manifest.json", "slurm_job.json"]), update
            assert load_file(str(update / ADAPTER_FILE)).keys() == a0.keys()
        assert set(verify_checkpoint(rounds / str(r) / "global").files) == {
            ADAPTER_FILE, ADAPTER_CONFIG_FILE}
    done = [r for r in status["rounds"] if r["state"] == "completed"]
    assert [r["round"] for r in done] == list(ROUNDS)
    for site in SITES:
        losses = [next(s["loss"] for s in r["sites"] if s["site"] == site) for r in done]
        assert all(a > b for a, b in itertools.pairwise(losses)), (site, losses)
    means = [r["loss"] for r in done]
    assert all(a > b for a, b in itertools.pairwise(means)), means


def globals_are_weighted_means(run_dir: Path) -> None:
    """Every round's global adapter is the sample-weighted mean of the updates that came back
    (the sites hold unequal data, so an unweighted mean is not one)."""
    rounds = run_dir / "rounds"
    for r in ROUNDS:
        ups = {s: verify_checkpoint(rounds / str(r) / "updates" / s) for s in SITES}
        assert len({u.num_samples for u in ups.values()}) == len(SITES), ups
        tensors = {s: load_file(str(rounds / str(r) / "updates" / s / ADAPTER_FILE))
                   for s in ups}
        total = sum(u.num_samples for u in ups.values())
        for name, got in load_file(str(rounds / str(r) / "global" / ADAPTER_FILE)).items():
            expected = sum(ups[s].num_samples * tensors[s][name].astype(np.float64)
                           for s in ups) / total
            # the aggregator's float64 average (2 products, 1 sum, 1 division) is within
            # 8 * 2^-53 * max|x_i| of this one and rounded once to fp32 (<= 2^-24 relative):
            # rtol 2^-23, atol 16 * 2^-53 * max|x_i| (<= 4e-8 here, |x| <= 0.32). An
            # unweighted mean moves an element by |w_alpha - 1/2| |x_alpha - x_beta| (230 and
            # 144 samples: 0.115 x the sites' difference; measured: up to 2.5e-2 in B)
            xmax = max(float(np.abs(tensors[s][name]).max()) for s in ups)
            np.testing.assert_allclose(got, expected, rtol=2**-23, atol=16 * 2**-53 * xmax,
                                       err_msg=name)


def freeze_a_is_exact(run_dir: Path) -> None:
    """freeze_a: A is round 0's everywhere, and the global's B·A is the weighted mean of the
    sites' products B_i·A (A is the same at every site, so that mean is (mean B_i)·A).

    Bound, elementwise: the global's B is the aggregator's float64 mean of the B_i (within
    8 * 2^-53 * max_i |B_i| of the exact mean, as in :func:`globals_are_weighted_means`)
    rounded once to fp32 (<= 2^-24 |B|), so |B·A - mean B_i·A|_jl <= sum_k (2^-24 |B|_jk
    + 8 * 2^-53 max_i |B_i|_jk) |A|_kl; this test's own float64 products and sum (r = 4
    terms each, then 2 sites) add <= 8 * 2^-53 of sum_k (|B| + max_i |B_i|)_jk |A|_kl.
    Hence tol = 2^-24 |B|·|A| + 16 * 2^-53 (|B| + max_i |B_i|)·|A| (<= 5e-9 here, gap
    measured <= 2.1e-9). An unweighted mean of the B_i moves the product by up to 7e-3, a
    global B rounded through bfloat16 (2^-9 |B|·|A|) by up to 1.4e-4 (measured on this run).
    """
    rounds = run_dir / "rounds"
    a0 = load_file(str(rounds / "0" / "global" / ADAPTER_FILE))
    for r in ROUNDS:
        g = load_file(str(rounds / str(r) / "global" / ADAPTER_FILE))
        ups = [rounds / str(r) / "updates" / s for s in SITES]
        w = np.array([read_manifest(u).num_samples for u in ups], dtype=np.float64)
        w /= w.sum()
        sites = [load_file(str(u / ADAPTER_FILE)) for u in ups]
        for module in adapted_modules(g):
            a, b = factor_names(module)
            assert all(np.array_equal(s[a], a0[a]) for s in [g, *sites])
            mean = sum(wi * (s[b].astype(np.float64) @ s[a].astype(np.float64))
                       for wi, s in zip(w, sites, strict=True))
            product = g[b].astype(np.float64) @ g[a].astype(np.float64)
            abs_a = np.abs(g[a].astype(np.float64))
            abs_b = np.abs(g[b].astype(np.float64))
            max_b = np.max([np.abs(s[b].astype(np.float64)) for s in sites], axis=0)
            tol = 2.0**-24 * (abs_b @ abs_a) + 16 * 2.0**-53 * ((abs_b + max_b) @ abs_a)
            assert np.all(np.abs(product - mean) <= tol), (r, module)


def world_reads(run_id: str, base0: Path, final: Path, tmp_path: Path) -> None:
    """The final adapter through transformers + peft, and merged by `xffl export --merge`
    into a plain transformers checkpoint, give xffl's logits.

    peft on transformers is the same modules as xffl's model (transformers' own class with
    peft's LoRA layers), holding the same fp32 base and adapter widened exactly to float64:
    the same float operations, so the same logits, bit for bit (a tolerance would hide a
    wrong scaling or a wrong target). The merged file holds every adapted weight
    W' = W + (alpha / r) B A rounded once to fp32: |dW| <= 2^-24 |W'|, which moves an
    adapted linear's output by <= 2^-24 S, S = max_j sum_k |x_k| |W'_jk| (measured below:
    S <= 4), and, first order with later gains <= 1 as in tests/training/test_parallelize.py,
    the logits by <= 14 linears * 2^-24 * S (<= 3.3e-6); the float64 arithmetic of both
    sides adds < 1e-12 (sums of at most 2 * 24 + 172 terms, <= 220 * 2^-53 relative, of
    logits below 10).
    """
    import transformers
    from peft import PeftModel

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    ours = lora.wrap(load_model(base0), LoraSpec.model_validate(LORA), False)
    lora.load_adapter(ours, read_weights(final), final)
    ours = ours.double().eval()
    wide = torch.float64
    with torch.no_grad():
        expected = ours(tokens)
        hf = transformers.LlamaForCausalLM.from_pretrained(str(base0), torch_dtype=wide)
        peft_model = PeftModel.from_pretrained(hf, str(final)).double().eval()
        assert torch.equal(peft_model(input_ids=tokens).logits, expected)

    out = tmp_path / "merged"
    result = runner.invoke(app, ["export", run_id, "--merge", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == ["config.json", "model.safetensors"]
    merged = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=wide).eval()
    sums: list[float] = []
    hooks = [m.register_forward_hook(lambda mod, args, _out: sums.append(float(
                 (args[0].abs() @ mod.weight.abs().T).max())))
             for n, m in merged.named_modules() if n.rsplit(".", 1)[-1] in TARGETS]
    with torch.no_grad():
        logits = merged(input_ids=tokens).logits
    for hook in hooks:
        hook.remove()
    assert len(sums) == 14 and max(sums) <= 4, sums
    assert (logits - expected).abs().max() <= 14 * 2.0**-24 * max(sums) + 1e-12
    result = runner.invoke(app, ["export", run_id, "-o", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        ADAPTER_CONFIG_FILE, ADAPTER_FILE]
