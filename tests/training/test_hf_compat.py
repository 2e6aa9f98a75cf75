"""Checkpoints go both ways between xffl and transformers, for every family, bit for bit.

The model xffl trains is transformers' own class of the checkpoint's family, loaded through
``from_pretrained``: the same modules, kernels and shapes compute the same bits on any CPU,
so the logits compare with ``torch.equal`` (a tolerance would hide a wrong weight or a
wrong config field: a wrong rope_theta moves these logits by ~1e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from xffl.training.arch import PRESETS
from xffl.training.checkpoint import init_global, load_model
from xffl.training.config import ModelSpec

FAMILIES = ["tiny", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2",
            "tiny-mixtral"]


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("preset", FAMILIES)
def test_transformers_loads_our_checkpoint(tmp_path: Path, preset: str) -> None:
    init_global("hf", ModelSpec(preset=preset), 1, tmp_path / "ours")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ours = load_model(tmp_path / "ours").eval()
    assert type(theirs) is type(ours)
    assert type(ours).__name__ == PRESETS[preset].to_hf_dict()["architectures"][0]
    with torch.no_grad():
        assert torch.equal(theirs(_ids(256), use_cache=False).logits, ours(_ids(256)))


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1234.0, "factor": 4.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("gemma2", {"head_dim": 8}),
])
def test_we_start_from_a_transformers_checkpoint(tmp_path: Path, model_type: str,
                                                 extra: dict[str, object]) -> None:
    """model.init: a save_pretrained folder (bf16 on disk) becomes round 0 in fp32, and the
    model xffl loads gives transformers' logits of the same fp32 weights."""
    config = AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, **extra)
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    init_global("hf", ModelSpec(init=str(tmp_path / "theirs")), 0, tmp_path / "round0")
    ours = load_model(tmp_path / "round0").eval()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "theirs",
                                                     dtype=torch.float32).eval()
    assert transformers.__version__  # the same library at both ends
    with torch.no_grad():
        assert torch.equal(reference(_ids(300), use_cache=False).logits, ours(_ids(300)))
