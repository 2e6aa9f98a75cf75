"""Checkpoints load in Hugging Face transformers with identical logits.

Tolerance (u = 2^-24, fp32). xffl's LLaMA is op for op transformers' (embedding, RMSNorm
in fp32, rotary tables and rotation, SwiGLU, residuals, LM head), and the same kernels on
the same shapes give the same bits on any CPU, except in the attention core: transformers
may pass a mask, its own scale or a GQA layout that selects another SDPA path, whose sums
(q.k over head_dim = 8, the softmax and p.v over <= T = 30 positions) are then ordered
differently. Per layer that is <= 8 + 2T = 68 summed terms, so over 2 layers the logits
(their sums S_z = sum|h W| <= 1.0 here; first order, gains of the later layers <= 1)
differ by <= 2 * 2 * 68 u S_z = 1.6e-5: atol 4e-5, rtol 0. Real mismatches are far
larger: a wrong rope_theta moves the logits by ~1e-3, a wrong rms_norm_eps by ~7e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from xffl.training.config import ModelSpec
from xffl.training.trainer import init_global, load_model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "rope_theta": 500.0,
                                            "num_key_value_heads": 1}])
def test_transformers_loads_our_checkpoint(tmp_path: Path,
                                           overrides: dict[str, int | float | bool]) -> None:
    init_global("hf", ModelSpec(preset="tiny-test", overrides=overrides), 1, tmp_path / "ours")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ours = load_model(tmp_path / "ours").eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=4e-5, rtol=0)


def test_we_load_a_transformers_checkpoint(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=1234.0, rms_norm_eps=1e-6)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    ours = load_model(tmp_path / "theirs").eval()
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=4e-5, rtol=0)
