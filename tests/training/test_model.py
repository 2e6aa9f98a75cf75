"""The LLaMA model: HF names, a from-scratch reference forward, configs and presets."""

from __future__ import annotations

import math

import pytest
import torch

from xffl.training.config import ModelSpec
from xffl.training.model import (
    PRESETS,
    LlamaConfig,
    build_config,
    build_model,
    export_state_dict,
    lm_loss,
    load_weights,
)

HF_NAMES_TWO_LAYERS = [
    "model.embed_tokens.weight",
    *[
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
    ],
    "model.norm.weight",
    "lm_head.weight",
]


def test_state_dict_names_and_shapes_are_hugging_face_llama() -> None:
    config = PRESETS["tiny"]
    state = build_model(config, seed=0).state_dict()
    assert sorted(state) == sorted(HF_NAMES_TWO_LAYERS)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads x 16
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (64, 172)
    assert state["lm_head.weight"].shape == (256, 64)
    assert sum(t.numel() for t in state.values()) == config.num_parameters()


def _ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _ref_rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) by angle pos * theta^(-2i/d), one pair at a time."""
    seq, d = x.shape[-2], x.shape[-1]
    out = torch.empty_like(x)
    for pos in range(seq):
        for i in range(d // 2):
            angle = pos * theta ** (-2.0 * i / d)
            a, b = x[..., pos, i], x[..., pos, i + d // 2]
            out[..., pos, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., pos, i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def _ref_forward(sd: dict[str, torch.Tensor], c: LlamaConfig, ids: torch.Tensor) -> torch.Tensor:
    """A literal LLaMA forward from the state dict: explicit per-head, masked attention."""
    d, n_rep = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    x = sd["model.embed_tokens.weight"][ids]
    seq = ids.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = _ref_rms(x, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = h @ sd[p + "self_attn.q_proj.weight"].T
        k = h @ sd[p + "self_attn.k_proj.weight"].T
        v = h @ sd[p + "self_attn.v_proj.weight"].T
        heads = []
        for head in range(c.num_attention_heads):
            kv = head // n_rep  # query heads share kv heads in consecutive groups
            qh = _ref_rotate(q[..., head * d:(head + 1) * d], c.rope_theta)
            kh = _ref_rotate(k[..., kv * d:(kv + 1) * d], c.rope_theta)
            vh = v[..., kv * d:(kv + 1) * d]
            scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(d)
            scores = scores.masked_fill(mask, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ vh)
        x = x + torch.cat(heads, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
        h = _ref_rms(x, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _ref_rms(x, sd["model.norm.weight"], c.rms_norm_eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_forward_matches_reference_gqa_and_rotary(kv_heads: int) -> None:
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=32,
                         rope_theta=500.0)
    model = build_model(config, seed=3)
    with torch.no_grad():  # larger weights than the init, so attention is far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(20.0)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
        want = _ref_forward({k: v.double() for k, v in model.state_dict().items()}, config, ids)
    assert got.shape == (2, 9, 50)
    # The reference runs in float64, so the difference is the fp32 model's own rounding: about
    # 12 chained products of length K <= 40, each within K * 2^-24 = 2.4e-6 of its operands'
    # magnitude, which the x20 weights make up to ~4x the result's (cancellation): < 1.2e-4
    # of the largest logit. A wrong mask, rotation or kv-head grouping moves logits by O(1).
    bound = 2e-4 * float(want.abs().max())
    assert float((got.double() - want).abs().max()) <= bound


def test_forward_is_causal() -> None:
    model = build_model(PRESETS["tiny-test"], seed=0)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_init_is_deterministic_and_as_specified() -> None:
    config = PRESETS["tiny-test"]
    a, b = build_model(config, seed=5).state_dict(), build_model(config, seed=5).state_dict()
    c = build_model(config, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(config.hidden_size))
    assert torch.equal(a["model.layers.1.input_layernorm.weight"], torch.ones(config.hidden_size))
    emb = a["model.embed_tokens.weight"]
    assert abs(float(emb.std()) - 0.02) < 0.002 and abs(float(emb.mean())) < 0.002


def test_untrained_loss_is_near_uniform_and_loss_uses_targets() -> None:
    model = build_model(PRESETS["tiny-test"], seed=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert abs(float(lm_loss(logits, ids)) - math.log(256)) < 0.05
    perfect = torch.full_like(logits, -30.0).scatter(-1, ids.unsqueeze(-1), 30.0)
    assert float(lm_loss(perfect, ids)) < 1e-6


def test_build_config_presets_and_overrides() -> None:
    llama = build_config(ModelSpec(preset="llama2-7b"))
    assert (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (
        4096, 11008, 32)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.vocab_size) == (
        32, 32, 32000)
    assert 6.7e9 < llama.num_parameters() < 6.8e9
    tiny = build_config(ModelSpec(preset="tiny", overrides={"num_hidden_layers": 3,
                                                            "rope_theta": 500}))
    assert tiny.num_hidden_layers == 3 and tiny.rope_theta == 500.0
    assert PRESETS["tiny"].num_hidden_layers == 2  # presets are not mutated
    with pytest.raises(ValueError, match="hidden_sise"):
        build_config(ModelSpec(preset="tiny", overrides={"hidden_sise": 8}))
    with pytest.raises(ValueError, match="no-such"):
        build_config(ModelSpec(preset="no-such"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_config(ModelSpec(preset="tiny", overrides={"num_key_value_heads": 3}))
    with pytest.raises(ValueError, match="integer"):
        build_config(ModelSpec(preset="tiny", overrides={"hidden_size": 64.5}))


def test_hf_config_round_trip() -> None:
    config = build_config(ModelSpec(preset="tiny", overrides={"rms_norm_eps": 1e-6}))
    hf = config.to_hf_dict()
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["hidden_act"] == "silu" and hf["torch_dtype"] == "float32"
    assert hf["head_dim"] == 16
    assert LlamaConfig.from_hf_dict(hf) == config
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf_dict({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}})
    # transformers 5 save_pretrained writes the RoPE base under rope_parameters.
    v5 = {k: v for k, v in hf.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    assert LlamaConfig.from_hf_dict(v5).rope_theta == 500.0
    with pytest.raises(ValueError, match="llama3"):
        LlamaConfig.from_hf_dict({**v5, "rope_parameters": {"rope_type": "llama3"}})


def test_tied_embeddings_export_and_load() -> None:
    config = LlamaConfig(**{**PRESETS["tiny-test"].__dict__, "tie_word_embeddings": True})
    model = build_model(config, seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    exported = export_state_dict(model)
    assert "lm_head.weight" not in exported
    fresh = build_model(config, seed=2)
    load_weights(fresh, exported)
    assert torch.equal(fresh.lm_head.weight, exported["model.embed_tokens.weight"])


def test_load_weights_rejects_mismatch() -> None:
    model = build_model(PRESETS["tiny-test"], seed=0)
    state = export_state_dict(model)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_weights(model, state)
    state = export_state_dict(model)
    state["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        load_weights(model, state)
