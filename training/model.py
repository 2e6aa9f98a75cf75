"""LLaMA-architecture decoder in plain torch, with Hugging Face LlamaForCausalLM parameter names.

The module tree mirrors ``transformers.LlamaForCausalLM`` so that ``state_dict()`` keys are
exactly the names of a Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``,
...). Nothing here knows about parallelism: attention reshapes by ``head_dim`` and derives the
number of local heads from the projected tensors, so tensor-parallel plans can split the
projections column-/row-wise from the outside (as torchtitan does). The config, presets and
``build_config`` live in :mod:`xffl.training.arch` and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from xffl.training.arch import PRESETS, LlamaConfig, apply_overrides, build_config

__all__ = [
    "PRESETS",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_overrides",
    "apply_rotary",
    "build_config",
    "build_model",
    "export_state_dict",
    "lm_loss",
    "load_weights",
    "rotate_half",
    "uniform_loss",
]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as Hugging Face's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalize the last dimension and scale by the learned weight."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings, HF LLaMA layout (halves concatenated)."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of shape (seq_len, head_dim) for positions 0..seq_len-1."""
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.to(device=device, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate (batch, heads, seq, head_dim) queries and keys by position."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions and no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over the sequence of x (batch, seq, hidden)."""
        bsz, seq, _ = x.shape
        # -1 heads: the local head count, so colwise-split projections work unchanged.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: Tensor = self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        return result


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated feed-forward block."""
        result: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Run one block."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        # As HF's gradient_checkpointing_enable(): recompute each block in backward.
        self.gradient_checkpointing = False

    def forward(self, input_ids: Tensor) -> Tensor:
        """Hidden states (batch, seq, hidden) after the final norm."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        result: Tensor = self.norm(x)
        return result


class LlamaForCausalLM(nn.Module):
    """Decoder plus language-model head; state_dict keys match transformers' LlamaForCausalLM."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )
        result: Tensor = self.lm_head(self.model(input_ids))
        return result

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init: N(0, initializer_range) for linears/embeddings, ones for norms.

        Initial models are cached by the version of this code: bump arch.INIT_VERSION when
        it changes.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        for name, param in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(mean=0.0, std=std, generator=gen)
                param.copy_(values)


def build_model(config: LlamaConfig, seed: int | None = None) -> LlamaForCausalLM:
    """A float32 model on the CPU, initialised deterministically when ``seed`` is given."""
    model = LlamaForCausalLM(config)
    if seed is not None:
        model.init_weights(seed)
    return model


def export_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """HF-named fp32 contiguous CPU tensors, ready for safetensors (tied head dropped)."""
    state = {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in model.state_dict().items()
    }
    config = getattr(model, "config", None)
    if isinstance(config, LlamaConfig) and config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_weights(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy HF-named tensors into the model; ValueError listing missing or unexpected names."""
    own = model.state_dict()
    given = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(own) - set(given))
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and missing == ["lm_head.weight"]:
        missing = []
    unexpected = sorted(set(given) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, value in given.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                f"the model expects {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, param in own.items():
            if name in given:
                param.copy_(given[name].to(param.dtype))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy; ``targets`` are the inputs shifted left by one."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a uniform prediction (what an untrained model scores)."""
    return math.log(vocab_size)
