"""LoRA under FSDP2 at dp 2 on gloo: one unit per decoder layer, the frozen base sharded and
kept in bf16 when the round computes in bf16, loaded per rank, and the same adapter as one
process trains (the ranks: tests/training/lora_fsdp_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.training.lora_fsdp_worker import built, train
from tests.training.tp_worker import mesh_spec
from tests.workflows.warm_ranks import rank_python
from xffl.aggregator.shards import ADAPTER_FILE
from xffl.training import lora, trainer
from xffl.training.checkpoint import init_global, read_config
from xffl.training.config import DataSpec, LoraSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.model import build_config

SPEC = LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
# a base wide enough that its weights dominate a rank's other allocations while loading
# (6.3 M parameters: 25 MB in fp32), still seconds to build and train on a CPU
WIDE = ModelSpec(preset="tiny-test", overrides={
    "hidden_size": 256, "intermediate_size": 1024, "vocab_size": 4096,
    "num_hidden_layers": 4})
MIB = 1 << 20


def _case(tmp: Path, name: str, model: ModelSpec, **training: Any) -> tuple[Path, Path,
                                                                          TrainJob]:
    """A round-0 base and adapter of ``model`` and a LoRA job on them (FSDP2, no clipping,
    AdamW eps 1: see test_an_fsdp2_rank_pair_trains_one_process_adapter)."""
    base, adapter = tmp / f"{name}-base", tmp / f"{name}-adapter0"
    init_global("run-test", model, 0, base)
    lora.init_adapter_global("run-test", model, SPEC, 0, adapter, "base")
    ensure_synthetic(tmp / "data", "alpha", 16, 16)
    spec = TrainingSpec(**{"steps": 3, "batch_size": 2, "seq_len": 16, "lr": 0.1,
                           "adam_eps": 1.0, "lora": SPEC, "data_parallel": "fsdp",
                           "grad_clip": 0.0, "weight_decay": 0.0, **training})
    return base, adapter, TrainJob(run_id="run-test", site="site-a", model=model,
                                   training=spec, data=DataSpec(
                                       path=str(tmp / "data"), synthetic="alpha",
                                       synthetic_sequences=16))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 2 ranks running every case: ``fp32`` (tiny-test, precision fp32, 3
    steps), ``qwen2`` (the same with Qwen2's tied embeddings and biases, and activation
    checkpointing) and ``bf16`` (WIDE, precision bf16, 1 step)."""
    tmp = tmp_path_factory.mktemp("lora-fsdp")
    cases = {"fp32": _case(tmp, "fp32", ModelSpec(preset="tiny-test"), precision="fp32"),
             # tied embeddings, biases and activation checkpointing, at tiny-test's widths
             "qwen2": _case(tmp, "qwen2", mesh_spec("tiny-qwen2"), precision="fp32",
                            activation_checkpointing=True),
             "bf16": _case(tmp, "bf16", WIDE, precision="bf16", steps=1)}
    args = []
    for name, (base, adapter, job) in cases.items():
        (tmp / f"{name}.json").write_text(job.model_dump_json())
        args.append(f"{name}:{base}:{adapter}:{tmp / f'{name}.json'}")
    out = tmp / "out"
    done = subprocess.run(
        [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
         "tests.training.lora_fsdp_worker", str(out), *args], capture_output=True,
        text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = {name: [json.loads((out / f"{name}.rank{k}.json").read_text()) for k in (0, 1)]
             for name in cases}
    return {"cases": cases, "ranks": ranks, "out": out}


@pytest.mark.slow
@pytest.mark.xdist_group("lora-fsdp")  # one worker launches the ranks once
def test_one_fsdp2_unit_per_decoder_layer_and_the_base_sharded(
        launched: dict[str, Any]) -> None:
    """FSDP2 shards the peft model per decoder layer (its LoRA factors inside) plus the root,
    and every frozen base weight is split over the 2 ranks: each holds half its elements."""
    for name, layers in (("fp32", 2), ("qwen2", 2), ("bf16", 4)):
        for ran in launched["ranks"][name]:
            assert ran["dp"] == 2 and ran["layers"] == layers, ran
            assert ran["fsdp_modules"] == layers + 1, ran
            frozen = ran["frozen"]
            assert frozen["sharded"] is True, ran
            assert frozen["local_numel"] * 2 == frozen["numel"], ran


@pytest.mark.slow
@pytest.mark.xdist_group("lora-fsdp")
@pytest.mark.parametrize("case", ["fp32", "qwen2"])
def test_an_fsdp2_rank_pair_trains_one_process_adapter(launched: dict[str, Any],
                                                       case: str) -> None:
    """The adapter 2 FSDP2 ranks train on the halves of each global batch is the one a
    single process trains on the whole batches (its model loaded whole, no process group).

    Tolerance (fp32, u = 2^-24): the two runs differ only in the order fp32 sums are taken
    (the dp all-gather and reduce-scatter move exact values; (a + b) / 2 of the two halves
    rounds once). test_parallelize's count at these widths: a gradient element sums N = 64
    tokens' terms and ~1200 along its forward and backward path, 2 (N + 1200) u S. An
    adapter's gradient term is a base weight's term (S <= 0.12 there) times the rank-4
    factor's output A x (|A| <= 1/sqrt(32), RMS-normed x: |A x| <= 1) and the scaling
    alpha / r = 2, with a few dozen more terms: |dg| <= 2 (64 + 1300) u 0.24 = 3.9e-5.
    Without clipping and with AdamW's eps = 1 (>> |g|) a step moves by at most 2 lr / eps
    per unit of gradient difference, plus the rounding of the weight (2^-23 |w|, |w| <=
    0.2): over 3 steps at lr 0.1, 3 (0.2 x 3.9e-5 + 2.4e-8) = 2.4e-5: atol 3e-5 (measured:
    1.6e-9; Qwen2, at the same widths, adds a bias per projection and ties the head). A loss
    scale that forgets the dp factor (each rank's half counted as the whole) makes them
    differ by 2.9e-3; the factors move by about 6e-3.
    """
    base, adapter, job = launched["cases"][case]
    pm = trainer.site_model(job, base, adapter, read_config(base), torch.device("cpu"))
    assert pm.mesh is None  # one process: the whole model, no FSDP2
    reference = train(pm, job, read_config(base).vocab_size, rows=4)
    got = load_file(str(launched["out"] / f"{case}.safetensors"))
    start = load_file(str(adapter / ADAPTER_FILE))
    assert got.keys() == reference.keys() == start.keys()
    gap = max(float((got[k] - reference[k]).abs().max()) for k in got)
    moved = max(float((reference[k] - start[k]).abs().max()) for k in got)
    assert gap <= 3e-5, gap
    assert moved > 1e-3, moved  # the factors trained far beyond the tolerance


@pytest.mark.slow
@pytest.mark.xdist_group("lora-fsdp")
def test_the_sharded_lora_load_never_holds_the_whole_base(launched: dict[str, Any]) -> None:
    """While the LoRA model loads, a rank's CPU tensors (torch's profiler, every allocation
    and free) never exceed its shard of the base, plus the largest single base tensor as
    read (fp32), plus the whole adapter (read whole: it is small), plus 1 MiB for the
    rotary tables, peft's module bookkeeping and gloo. Loading the whole base on each
    rank, the load before FSDP2 was sharded per rank, needs its 25 MB at least; this
    bound is about 11 MB."""
    for ran in launched["ranks"]["bf16"]:
        frozen, adapter = ran["frozen"], ran["adapter"]
        whole = frozen["numel"] * 4
        bound = (frozen["local_bytes"] + frozen["largest_fp32_bytes"]
                 + adapter["numel"] * 4 + MIB)
        assert bound < whole, (bound, whole)  # the bound rules the whole base out
        assert ran["load_peak_bytes"] <= bound, (ran["load_peak_bytes"], bound)


@pytest.mark.slow
@pytest.mark.xdist_group("lora-fsdp")
def test_a_bf16_round_keeps_the_frozen_base_in_bf16(launched: dict[str, Any]) -> None:
    """precision bf16: the frozen base is bfloat16 (half its memory) and the adapter float32
    (peft's autocast_adapter_dtype), under FSDP2; the adapter written out is float32.
    precision fp32 keeps the base in float32."""
    for ran in launched["ranks"]["bf16"]:
        assert ran["frozen"]["dtypes"] == ["torch.bfloat16"], ran
        assert ran["adapter"]["dtypes"] == ["torch.float32"], ran
    for ran in launched["ranks"]["fp32"]:
        assert ran["frozen"]["dtypes"] == ran["adapter"]["dtypes"] == ["torch.float32"], ran
    with safe_open(str(launched["out"] / "bf16.safetensors"), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"F32"}  # noqa: SIM118


def test_one_process_bf16_keeps_the_base_in_bf16(tmp_path: Path) -> None:
    """One process, precision bf16 (the CUDA default under auto): the base loads in bf16,
    the adapter stays fp32, and the round's update is written in fp32."""
    base, adapter, job = _case(tmp_path, "one", ModelSpec(preset="tiny-test"),
                               precision="bf16", steps=1)
    pm = trainer.site_model(job, base, adapter, read_config(base), torch.device("cpu"))
    ran = built(pm)
    assert ran["frozen"]["dtypes"] == ["torch.bfloat16"], ran
    assert ran["adapter"]["dtypes"] == ["torch.float32"], ran
    trainer.train_round(job, 1, adapter, Path(job.data.path), tmp_path / "update",
                        base_dir=base)
    with safe_open(str(tmp_path / "update" / ADAPTER_FILE), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"F32"}  # noqa: SIM118


def test_decoder_layers_are_found_through_peft() -> None:
    """A peft model's decoder layers are its transformers model's (what FSDP2 shards one
    unit each), its LoRA factors inside them; the meta build allocates nothing."""
    from xffl.training.parallelize import decoder_layers
    from xffl.training.sharded_load import meta_causal_lm

    config = build_config(ModelSpec(preset="tiny-test"))
    plain = meta_causal_lm(config, dtype=torch.bfloat16)
    peft_model = lora.wrap(plain, SPEC, freeze_a=False)
    layers = decoder_layers(peft_model)
    assert len(layers) == config.num_hidden_layers == 2
    assert layers == list(plain.model.layers)
    factors = [n for n, _ in layers[0].named_parameters() if lora.is_adapter_param(n)]
    assert len(factors) == 2 * 3  # A and B of q_proj, v_proj and down_proj
    assert {p.dtype for n, p in peft_model.named_parameters()
            if not lora.is_adapter_param(n)} == {torch.bfloat16}
    assert {p.dtype for n, p in peft_model.named_parameters()
            if lora.is_adapter_param(n)} == {torch.float32}
    assert lora.base_checkpoint_name(
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
