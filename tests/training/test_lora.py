"""LoRA through peft in one process: the round-0 adapter, a site's round, aggregation of A and B.

The 3-round workflow run, the transformers + peft logits and `xffl export --merge` are in
tests/workflows/test_slurm_sites.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.conftest import REPO
from tests.workflows.warm_ranks import rank_python
from xffl.aggregator.adapter import adapted_modules, factor_names
from xffl.aggregator.engine import run_strategy
from xffl.aggregator.exchange import Manifest, read_manifest, verify_checkpoint
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from xffl.core.errors import InvalidInput
from xffl.training import lora
from xffl.training.checkpoint import init_global, load_model, read_weights
from xffl.training.config import LoraSpec, ModelSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.model import build_config
from xffl.training.trainer import train_round

JobFactory = Callable[..., TrainJob]
SPEC = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _lora_job(make_job: JobFactory, data: Path, site: str, language: str,
              freeze_a: bool = False, sequences: int = 32) -> TrainJob:
    job = make_job(data, site=site, language=language, sequences=sequences, steps=3, lr=1e-2)
    training = job.training.model_copy(update={"lora": SPEC})
    job = job.model_copy(update={"training": training, "freeze_a": freeze_a})
    assert job.data.synthetic is not None
    ensure_synthetic(data, job.data.synthetic, sequences, job.training.seq_len)
    return job


@pytest.fixture
def adapter0(tmp_path: Path) -> Path:
    """Round 0's global adapter for the tiny-test preset."""
    out = tmp_path / "adapter0"
    lora.init_adapter_global("run-test", ModelSpec(preset="tiny-test"), SPEC, 0, out, "base")
    return out


def test_round_zero_adapter_is_peft_shaped(adapter0: Path,
                                           global0: tuple[Path, Manifest]) -> None:
    """peft's own state dict of the wrapped model has exactly these names and shapes; B is
    zero (the adapted model starts as the base), A within peft's Kaiming-uniform bound."""
    manifest = verify_checkpoint(adapter0)
    assert set(manifest.files) == {ADAPTER_FILE, ADAPTER_CONFIG_FILE}
    tensors = load_file(str(adapter0 / ADAPTER_FILE))
    from peft import get_peft_model_state_dict

    wrapped = lora.wrap(load_model(global0[0]), SPEC, freeze_a=False)
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(wrapped).items()}
    assert {k: v.shape for k, v in tensors.items()} == expected
    modules = adapted_modules(tensors)
    assert len(modules) == 2 * 3  # two layers of tiny-test, three targets each
    for module in modules:
        a, b = (tensors[n] for n in factor_names(module))
        # kaiming_uniform_(a=sqrt(5)): bound = gain * sqrt(3 / fan_in), gain = sqrt(2 / 6)
        assert np.abs(a).max() <= 1 / math.sqrt(a.shape[1]) and np.abs(a).max() > 0
        assert not b.any()
    config = json.loads((adapter0 / ADAPTER_CONFIG_FILE).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    # the same seed gives the same adapter, bit for bit
    again = lora.init_adapter_global("run-test", ModelSpec(preset="tiny-test"), SPEC, 0,
                                     adapter0.parent / "again", "base")
    assert again.files[ADAPTER_FILE] == manifest.files[ADAPTER_FILE]


def test_targets_that_match_nothing_are_refused() -> None:
    spec = LoraSpec(target_modules=["qkv"])
    with pytest.raises(InvalidInput, match="match no linear layer of the model; its linear "
                       "layers are down_proj, gate_proj, k_proj, lm_head, o_proj"):
        lora.initial_adapter(build_config(ModelSpec(preset="tiny-test")), None, spec, 0)


def test_a_site_round_trains_the_adapter_only(tmp_path: Path, adapter0: Path,
                                              global0: tuple[Path, Manifest],
                                              make_job: JobFactory) -> None:
    """The update holds the adapter alone, and the frozen base is untouched. (Whether 3
    steps lower the loss on 3 different batches of a random base is noise, not a property:
    the two-site LoRA run checks the trained adapter against transformers and peft.)"""
    base, _ = global0
    before = {k: v.clone() for k, v in read_weights(base).items()}
    job = _lora_job(make_job, tmp_path / "data", "site-a", "alpha")
    out = tmp_path / "update"
    manifest = train_round(job, 1, adapter0, Path(job.data.path), out, base_dir=base)
    assert set(manifest.files) == {ADAPTER_FILE, ADAPTER_CONFIG_FILE}
    assert manifest.parent == read_manifest(adapter0).digest()
    assert (out / ADAPTER_CONFIG_FILE).read_bytes() == (adapter0 / ADAPTER_CONFIG_FILE).read_bytes()
    update, start = load_file(str(out / ADAPTER_FILE)), load_file(str(adapter0 / ADAPTER_FILE))
    assert update.keys() == start.keys()
    assert all(not np.array_equal(update[k], start[k]) for k in update)  # A and B trained
    after = read_weights(base)
    assert all(torch.equal(before[k], after[k]) for k in before)

    frozen = _lora_job(make_job, tmp_path / "data", "site-a", "alpha", freeze_a=True)
    out_f = tmp_path / "update-frozen"
    train_round(frozen, 1, adapter0, Path(job.data.path), out_f, base_dir=base)
    kept = load_file(str(out_f / ADAPTER_FILE))
    for module in adapted_modules(kept):
        a, b = factor_names(module)
        assert np.array_equal(kept[a], start[a]) and kept[b].any()


def test_separate_aggregation_is_the_mean_of_each_factor(
        tmp_path: Path, adapter0: Path, global0: tuple[Path, Manifest],
        make_job: JobFactory) -> None:
    """aggregation.lora: separate averages A and B each on its own (FedAvg of every tensor),
    as docs/aggregation.md states; the product of the averages is not the average of the
    products, which the test shows on the same numbers. The sites hold 48 and 32 sequences,
    so the mean is weighted 3:2 (equal sites would hide an unweighted mean)."""
    base, _ = global0
    updates = []
    for site, language, sequences in (("site-a", "alpha", 48), ("site-b", "beta", 32)):
        job = _lora_job(make_job, tmp_path / site, site, language, sequences=sequences)
        updates.append(tmp_path / f"u-{site}")
        train_round(job, 1, adapter0, Path(job.data.path), updates[-1], base_dir=base)
    out = tmp_path / "global1"
    run_strategy("fedavg", updates, adapter0, out)
    assert set(read_manifest(out).files) == {ADAPTER_FILE, ADAPTER_CONFIG_FILE}
    weights = np.array([read_manifest(u).num_samples for u in updates], dtype=np.float64)
    assert weights.tolist() == [48, 32]
    weights /= weights.sum()
    sites = [load_file(str(u / ADAPTER_FILE)) for u in updates]
    glob = load_file(str(out / ADAPTER_FILE))
    gap = 0.0
    for module in adapted_modules(glob):
        a, b = factor_names(module)
        for name in (a, b):
            # the aggregator's float64 mean (2 products, 1 sum, 1 division) is within
            # 8 * 2^-53 * max|x_i| of this one, then rounded once to fp32 (2^-24 relative)
            mean = sum(w * s[name].astype(np.float64) for w, s in zip(weights, sites,
                                                                       strict=True))
            xmax = max(float(np.abs(s[name]).max()) for s in sites)
            assert np.all(np.abs(glob[name] - mean)
                          <= 2.0**-24 * np.abs(mean) + 16 * 2.0**-53 * xmax)
        products = sum(w * (s[b].astype(np.float64) @ s[a].astype(np.float64))
                       for w, s in zip(weights, sites, strict=True))
        gap = max(gap, float(np.abs(glob[b].astype(np.float64) @ glob[a] - products).max()))
    assert gap > 1e-6  # separate: B̄·Ā differs from the mean of the B_i·A_i
    # every strategy applies to the factors as to any tensor, and writes an adapter
    for strategy in ("fedadam", "fedmedian"):
        other = tmp_path / f"global1-{strategy}"
        run_strategy(strategy, updates, adapter0, other)
        tensors = load_file(str(other / ADAPTER_FILE))
        assert tensors.keys() == glob.keys()
        assert (other / ADAPTER_CONFIG_FILE).read_bytes() == \
            (adapter0 / ADAPTER_CONFIG_FILE).read_bytes()
        if strategy == "fedmedian":  # two sites: the median is their unweighted mean
            for k in glob:
                half = (sites[0][k].astype(np.float64) + sites[1][k]) / 2
                assert np.allclose(tensors[k], half, rtol=2**-23, atol=0), k


def test_a_model_of_the_users_own(tmp_path: Path, make_job: JobFactory) -> None:
    """model.entry_point models take LoRA too: peft's names for their own modules
    (``mlp.0``, an nn.Sequential child, and ``head``), trained and sent alone."""
    entry = "tests.training.custom_model:build"
    model = ModelSpec(preset="tiny-test", entry_point=entry)
    spec = LoraSpec(r=2, alpha=4, target_modules=["mlp.0", "head"])
    base = tmp_path / "base"
    init_global("run-test", model, 0, base)
    adapter = tmp_path / "adapter0"
    lora.init_adapter_global("run-test", model, spec, 0, adapter, str(base))
    assert adapted_modules(load_file(str(adapter / ADAPTER_FILE))) == ["head", "mlp.0"]
    job = make_job(tmp_path / "data", sequences=32, steps=2)
    job = job.model_copy(update={"model": model, "training": job.training.model_copy(
        update={"lora": spec})})
    ensure_synthetic(Path(job.data.path), "alpha", 32, job.training.seq_len)
    manifest = train_round(job, 1, adapter, Path(job.data.path), tmp_path / "u", base_dir=base)
    assert {t.name for t in manifest.tensors} == {
        t.name for t in read_manifest(adapter).tensors}
    with pytest.raises(InvalidInput, match="its linear layers are 0, 2, head"):
        lora.initial_adapter(build_config(model), entry, LoraSpec(target_modules=["q_proj"]), 0)


@pytest.mark.slow
def test_fsdp2_trains_the_adapter_as_ddp_does(tmp_path: Path, adapter0: Path,
                                              global0: tuple[Path, Manifest],
                                              make_job: JobFactory) -> None:
    """Two ranks under torchrun, the frozen base and its adapter wrapped by DDP or by FSDP2
    (``data_parallel: fsdp``: one unit per decoder layer, its LoRA factors inside, plus the
    root; the base loaded into each rank's shards): the same adapter comes back, bit for bit
    (both rounds in one launch, tests/training/lora_worker.py).

    Why bit for bit: both ranks run the same forward and backward on the same batches with
    the same weights (FSDP2 all-gathers the exact shards); with two ranks the reduction is
    one sum a + b (commutative, so its order cannot matter) and a division by 2 (exact),
    whether DDP all-reduces or FSDP2 reduce-scatters; AdamW is elementwise, so a shard's
    step is the full tensor's. Gradient clipping is off (grad_clip 0): a norm summed over
    shards in another order could round differently.
    """
    base, _ = global0
    job = _lora_job(make_job, tmp_path / "data", "site-a", "alpha")
    jobs = []
    for mode in ("ddp", "fsdp"):
        training = job.training.model_copy(update={"data_parallel": mode, "grad_clip": 0.0})
        jobs.append(tmp_path / f"{mode}.json")
        jobs[-1].write_text(job.model_copy(update={"training": training}).model_dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
         "tests.training.lora_worker", str(adapter0), str(base), job.data.path,
         str(tmp_path / "out"), *map(str, jobs)], capture_output=True, text=True,
        timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp, fsdp = (load_file(str(tmp_path / "out" / m / ADAPTER_FILE)) for m in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys() == load_file(str(adapter0 / ADAPTER_FILE)).keys()
    assert all(np.array_equal(ddp[k], fsdp[k]) for k in ddp)
    assert read_manifest(tmp_path / "out" / "fsdp").extra["dp"] == 2
    # what ran, not what was asked for (the comparison above holds for DDP against DDP):
    # FSDP2 made each of tiny-test's 2 decoder layers of the peft model an FSDPModule, and
    # the root, and every parameter, the frozen base's included, a DTensor sharded on dim 0
    # over the 2 ranks (a frozen weight's local shard: half its elements); DDP wrapped a
    # model of plain tensors
    for rank in (0, 1):
        ran = {m: json.loads((tmp_path / "out" / f"{m}.rank{rank}.json").read_text())
               for m in ("ddp", "fsdp")}
        assert ran["fsdp"]["ddp"] is False and int(ran["fsdp"]["fsdp_modules"]) == 2 + 1, ran
        assert ran["fsdp"]["dtensor_params"] == ran["fsdp"]["params"], ran
        assert ran["fsdp"]["placements"] == "(Shard(dim=0),)", ran
        assert ran["fsdp"]["frozen_grad"] is False, ran
        assert ran["fsdp"]["frozen_local_numel"] * 2 == ran["fsdp"]["frozen_numel"], ran
        assert ran["ddp"]["frozen_local_numel"] == ran["ddp"]["frozen_numel"], ran
        assert ran["ddp"]["ddp"] is True and int(ran["ddp"]["fsdp_modules"]) == 0, ran
        assert int(ran["ddp"]["dtensor_params"]) == 0, ran


@pytest.mark.parametrize("preset", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral",
                                    "tiny-gemma2", "tiny-mixtral"])
def test_lora_on_every_family(tmp_path: Path, make_job: JobFactory, preset: str) -> None:
    """peft adapts the attention projections of every family: round 0's adapter has peft's
    own names and shapes for that family, a site's round trains A and B and leaves the
    frozen base untouched."""
    from peft import get_peft_model_state_dict

    spec = LoraSpec(r=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
    base, adapter0 = tmp_path / "base", tmp_path / "adapter0"
    init_global("run-test", ModelSpec(preset=preset), 0, base)
    lora.init_adapter_global("run-test", ModelSpec(preset=preset), spec, 0, adapter0, "base")
    start = load_file(str(adapter0 / ADAPTER_FILE))
    wrapped = lora.wrap(load_model(base), spec, freeze_a=False)
    assert {k: v.shape for k, v in start.items()} == {
        k: tuple(v.shape) for k, v in get_peft_model_state_dict(wrapped).items()}
    assert len(adapted_modules(start)) == 2 * 2  # 2 layers x (q_proj, v_proj)
    job = make_job(tmp_path / "data", steps=2, sequences=16)
    ensure_synthetic(tmp_path / "data", "alpha", 16, job.training.seq_len)
    job = job.model_copy(update={"model": ModelSpec(preset=preset),
                                 "training": job.training.model_copy(update={"lora": spec})})
    before = read_weights(base)
    train_round(job, 1, adapter0, Path(job.data.path), tmp_path / "update", base_dir=base)
    update = load_file(str(tmp_path / "update" / ADAPTER_FILE))
    assert update.keys() == start.keys()
    assert all(not np.array_equal(update[k], start[k]) for k in update)
    after = read_weights(base)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("preset", ["tiny-test", "tiny-qwen2"])  # lm_head untied, then tied
def test_an_adapter_of_lm_head_loads_in_peft_and_merges(tmp_path: Path, make_job: JobFactory,
                                                        preset: str) -> None:
    """LoRA with ``lm_head`` among the targets: a site loads round 0's adapter and trains it
    (peft's own state dict of such a model also holds lm_head's whole base weight, which is
    not the adapter's), the update holds the factors only, it loads in peft on the base and
    generates, and its logits are those of the adapter merged into the base (`xffl export
    --merge`), also when the base ties lm_head to the input embedding (its checkpoint has no
    lm_head.weight: the merged one gets its own, untied).

    Tolerance: both models run in float64 on the same float32 values, except that the
    merged weights W + (alpha/r) B A are rounded once to float32 (relative error u = 2^-24
    per element). A logit then moves by at most u sum_j |W'_ij x_j| per merged linear;
    with |W'| <= 0.5 and |x_j| <= 8 (RMS-normed hidden states of width 64) that is below
    64 x 0.5 x 8 x 6e-8 = 1.5e-5 for lm_head, and the q_proj errors reach the logits
    damped by attention's softmax and the head: 1e-4 holds with a wide margin, while the
    adapter moves the logits by more than 1e-2 (asserted; measured: 0.1 apart, 2e-8 merged).
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from xffl.aggregator.merge import merge_adapter

    spec = LoraSpec(r=2, alpha=4.0, target_modules=["q_proj", "lm_head"])
    base, adapter0 = tmp_path / "base", tmp_path / "adapter0"
    init_global("run-test", ModelSpec(preset=preset), 0, base)
    lora.init_adapter_global("run-test", ModelSpec(preset=preset), spec, 0, adapter0, "base")
    job = make_job(tmp_path / "data", steps=3, sequences=16, lr=1e-2)
    ensure_synthetic(tmp_path / "data", "alpha", 16, job.training.seq_len)
    job = job.model_copy(update={"model": ModelSpec(preset=preset),
                                 "training": job.training.model_copy(update={"lora": spec})})
    update = tmp_path / "update"
    train_round(job, 1, adapter0, Path(job.data.path), update, base_dir=base)
    tensors = load_file(str(update / ADAPTER_FILE))
    assert tensors.keys() == load_file(str(adapter0 / ADAPTER_FILE)).keys()
    assert "lm_head" in adapted_modules(tensors)
    assert tensors[factor_names("lm_head")[1]].any()  # lm_head's B trained

    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 129, 200]])
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float64).eval()
    with torch.no_grad():
        before = plain(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(plain, str(update)).eval()
    merge_adapter(base, update, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                  dtype=torch.float64).eval()
    with torch.no_grad():
        peft_logits, merged_logits = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        generated = adapted.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        merged_generated = merged.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert float((peft_logits - before).abs().max()) > 1e-2  # the adapter is not a no-op
    assert float((peft_logits - merged_logits).abs().max()) <= 1e-4
    assert generated.shape == (1, ids.shape[1] + 4)
    assert torch.equal(generated, merged_generated)
