"""The memory model against the training code: measured per-rank peaks at three shapes on
CPU, and the model's GPU terms for the layouts the large templates use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.training.memory_worker import STATE_SHAPE, measure
from xffl.training.arch import PRESETS, apply_overrides
from xffl.training.config import LoraSpec, TrainingSpec
from xffl.training.memory_model import (
    GIB,
    Layout,
    checkpoint_every,
    estimate,
    model_parts,
    site_layout,
)

# (overrides of tiny-test, batch, seq, activation checkpointing, the term that dominates)
SHAPES = [
    (STATE_SHAPE, 1, 16, False, "state"),
    ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4}, 8, 256, False,
     "activations"),
    ({"hidden_size": 64, "intermediate_size": 128, "vocab_size": 16384}, 4, 128, True,
     "logits"),
]


@pytest.mark.parametrize(("overrides", "batch", "seq", "ac", "dominant"), SHAPES,
                         ids=[s[-1] for s in SHAPES])
def test_estimate_within_20_percent_of_measured_peak(overrides: dict[str, int], batch: int,
                                                     seq: int, ac: bool,
                                                     dominant: str) -> None:
    """The issue's bound, 20 %: the model leaves out tensors below 1 % of each peak here
    (RMSNorm's rsqrt, SDPA's logsumexp, rotary cos/sin, the loss scalars) and takes the
    backward's working set as one layer's activations; the estimate over the measurement is
    0.971, 0.984 and 0.999 at these shapes. A wrong term breaks it: without AdamW's 8 B/param
    the "state" shape's ratio is 0.49; counting the s x s attention scores and their softmax
    (a kernel that keeps them) the "activations" shape's is 2.8; the logits at 8 B per token
    and vocabulary entry instead of 12 (forgetting the backward's gradients), 0.74."""
    measured, est = measure(overrides, batch, seq, ac)
    terms = est.terms
    sizes = {"state": terms["weights"] + terms["grads"] + terms["adam"],
             "activations": terms["activations"], "logits": terms["logits"]}
    assert max(sizes, key=lambda k: sizes[k]) == dominant, sizes
    assert 0.8 * measured <= est.peak <= 1.2 * measured, (est.peak / measured, est.phase)


def test_ddp_at_dp_2_within_20_percent(tmp_path: Path) -> None:
    """Two gloo ranks under DDP (the forked launcher, as CPU sites run): each rank holds
    the replicated state, 16 B/param in the optimizer step: DDP's gradients are views into
    its buckets (gradient_as_bucket_view). Measured 52.3 MiB per rank against 50.8 estimated
    (0.97); counting the buckets as a copy of the gradients (4 B/param more, as DDP holds
    them without the view) the estimate is 63.3 MiB (1.21), outside the bound."""
    cmd = [sys.executable, "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
           "tests.training.memory_worker", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["ddp_buckets"] == 0  # the gradients are the buckets
        assert 0.8 * got["measured"] <= got["estimate"] <= 1.2 * got["measured"], got


def test_gpu_terms_of_an_8b_fsdp2_site() -> None:
    """Llama-3.1-8B, FSDP2 over 8 GPUs, bf16 params / fp32 reduce: the persistent state is
    16 B/param / 8 (2.0 B/param), the root unsharded in bf16 is 2 B x 1.05e9, the logits at
    4 x 2048 tokens cost 12 B x 8192 x 128256 (12.6 GB) unchunked, chunks of 2048 tokens a
    quarter, the default chunk of 1024 tokens an eighth."""
    parts = model_parts(PRESETS["llama3.1-8b"])
    assert parts.total == 8_030_261_248 and parts.head == parts.embedding == 128256 * 4096
    spec = TrainingSpec(batch_size=4, seq_len=2048, activation_checkpointing=True,
                        data_parallel="fsdp", loss_chunk=0)
    layout = site_layout(spec, 8, parts)
    default = site_layout(TrainingSpec(batch_size=4, seq_len=2048, data_parallel="fsdp"), 8,
                          parts)
    assert estimate(parts, default).terms["logits"] == 12 * 1024 * 128256
    assert (layout.mode, layout.dp, layout.tp, layout.bf16, layout.ac_every) == (
        "fsdp", 8, 1, True, 1)
    terms = estimate(parts, layout).terms
    assert terms["weights"] + terms["grads"] + terms["adam"] == 16 * parts.total // 8
    assert terms["unsharded_root"] == 2 * parts.root
    assert terms["logits"] == 12 * 4 * 2048 * 128256
    # AC every layer: each layer keeps its bf16 input, 2 B x hidden per token
    assert terms["activations"] == 32 * 2 * 4096 * 8192 + 6 * 4096 * 8192
    chunked = estimate(parts, Layout(**{**layout.__dict__, "loss_chunk": 2048}))
    assert chunked.terms["logits"] == terms["logits"] // 4
    # every 2nd layer checkpointed: the other 16 keep their whole activations
    every2 = estimate(parts, Layout(**{**layout.__dict__, "ac_every": 2}))
    assert every2.terms["activations"] > 10 * terms["activations"]
    off = estimate(parts, Layout(**{**layout.__dict__, "ac_every": 0}))
    assert off.peak > every2.peak > estimate(parts, layout).peak


def test_lora_keeps_a_bf16_base_and_an_fp32_adapter() -> None:
    lora = LoraSpec(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    parts = model_parts(PRESETS["llama3.1-8b"], lora)
    # q: 4096 -> 4096, k and v: 4096 -> 1024, o: 4096 -> 4096; r x (in + out) each
    assert parts.lora_layer == 16 * (8192 + 5120 + 5120 + 8192) and parts.lora_other == 0
    spec = TrainingSpec(batch_size=4, seq_len=2048, activation_checkpointing=True,
                        data_parallel="fsdp", lora=lora)
    terms = estimate(parts, site_layout(spec, 4, parts)).terms
    assert terms["weights"] == 2 * parts.total // 4 + 4 * (parts.adapter // 4)
    assert terms["adam"] == 8 * (parts.adapter // 4)


def test_data_parallel_auto_and_checkpointing_values() -> None:
    parts = model_parts(PRESETS["llama3.1-8b"])
    small = model_parts(PRESETS["tiny"])
    spec = TrainingSpec()
    assert site_layout(spec, 4, parts).mode == "fsdp"  # auto: FSDP2 from ~1B parameters
    assert site_layout(spec, 4, small).mode == "ddp"
    assert site_layout(spec, 1, small).mode == "none"
    assert [checkpoint_every(v) for v in (False, True, 0, 1, 3, None)] == [0, 1, 0, 1, 3, 0]
    assert estimate(parts, site_layout(spec, 4, parts)).peak > GIB


@pytest.mark.parametrize("preset", ["tiny", "tiny-test", "tiny-llama3", "tiny-mistral",
                                    "llama2-7b", "llama3.1-8b", "mistral-7b"])
def test_config_counts_equal_the_meta_models(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaMA-style families are counted from config.json (no torch for `xffl validate`):
    the same parts as the meta-device model, LoRA adapters included."""
    from xffl.training import memory_model

    config = apply_overrides(PRESETS[preset], {"tie_word_embeddings": True}) \
        if preset == "tiny" else PRESETS[preset]
    lora = LoraSpec(r=4, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"]) \
        if not config.tie_word_embeddings else LoraSpec(r=4, target_modules=["k_proj"])
    fast = model_parts(config, lora)
    monkeypatch.setattr(memory_model, "LLAMA_LIKE", ())
    assert fast == model_parts(config, lora)


def test_auto_is_the_trainers_choice_on_a_small_gpu() -> None:
    """`xffl validate` and the trainer decide ``auto`` by one rule: a 0.74 B model is under
    the 1 B threshold, but its 16 B/parameter (11.9 GB) exceed half of a 16 GiB card, so both
    shard it; on an 80 GiB card (or with no GPU declared) both replicate it."""
    from xffl.training.parallelize import data_parallel_mode

    mid = model_parts(apply_overrides(PRESETS["llama3.1-8b"], {"num_hidden_layers": 1,
                                                             "tie_word_embeddings": True}))
    assert 0.5e9 < mid.total < 1e9
    for memory, mode in ((16 * GIB, "fsdp"), (80 * GIB, "ddp"), (None, "ddp")):
        layout = site_layout(TrainingSpec(), 4, mid, gpu_memory=memory)
        assert layout.mode == mode == data_parallel_mode("auto", 1, mid.total, memory)
