"""Architecture hyper-parameters of the LLaMA model: the config, presets and job overrides.

Field names are those of Hugging Face's LLaMA config.json, so a checkpoint's config.json
round-trips through :class:`LlamaConfig` and loads in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xffl.core.errors import InvalidInput
from xffl.training.config import ModelSpec

# The version of the seeded initialisation (model.LlamaForCausalLM.init_weights): cached
# initial models (xffl.workflows.init_cache) are keyed by it. Bump it whenever that code changes.
INIT_VERSION = 1


@dataclass
class LlamaConfig:
    """Architecture hyper-parameters, with the field names of Hugging Face's config.json."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 172
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        """Raise ValueError when the numbers do not describe a buildable model."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0 or self.initializer_range <= 0:
            raise ValueError("rms_norm_eps, rope_theta and initializer_range must be positive")

    def num_parameters(self) -> int:
        """Number of trainable parameters (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        kv = self.num_key_value_heads * d
        layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers' LlamaConfig / AutoConfig accepts."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "use_cache": True,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]) -> LlamaConfig:
        """Read a Hugging Face LLaMA config.json; ValueError for features this model lacks."""
        if data.get("model_type", "llama") != "llama":
            raise ValueError(f"model_type {data.get('model_type')!r} is not 'llama'")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {data.get('hidden_act')!r} is not supported (silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"{flag}=true is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        # transformers >= 5 writes rope_parameters {rope_type, rope_theta}; 4.x rope_scaling.
        for key in ("rope_scaling", "rope_parameters"):
            rope = data.get(key) or {}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                raise ValueError(f"{key} of type {kind!r} is not supported (only default RoPE)")
            if "rope_theta" in rope:
                kwargs["rope_theta"] = rope["rope_theta"]
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        config = cls(**kwargs)
        head_dim = data.get("head_dim")
        if head_dim is not None and head_dim != config.head_dim:
            raise ValueError(
                f"head_dim {head_dim} differs from hidden_size / num_attention_heads "
                f"({config.head_dim}); not supported"
            )
        config.validate()
        return config


PRESETS: dict[str, LlamaConfig] = {
    # Quickstart: byte-level, ~0.12 M parameters; trains visibly in seconds on a CPU core.
    "tiny": LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    # Unit tests: as small as possible while still exercising GQA (4 heads over 2 kv heads).
    "tiny-test": LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    # meta-llama/Llama-2-7b-hf.
    "llama2-7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    ),
}


def _coerce(name: str, current: Any, value: int | float | bool) -> Any:
    """Check an override's type against the field it replaces."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ValueError(f"override {name} must be true or false, got {value!r}")
        return value
    if isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"override {name} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ValueError(f"override {name} must be a number, got {value!r}")
    return float(value)


def apply_overrides(
    config: LlamaConfig, overrides: Mapping[str, int | float | bool]
) -> LlamaConfig:
    """A copy of ``config`` with HF-named fields replaced; ValueError naming any unknown key."""
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(
                f"unknown model override {key!r}; known fields: {', '.join(sorted(fields))}"
            )
        changes[key] = _coerce(key, getattr(config, key), value)
    new = dataclasses.replace(config, **changes)
    new.validate()
    return new


def build_config(spec: ModelSpec) -> LlamaConfig:
    """The LlamaConfig a ModelSpec describes: preset (or ``init``'s config.json) plus overrides."""
    if spec.init is not None:
        path = Path(spec.init) / "config.json"
        try:
            base = LlamaConfig.from_hf_dict(json.loads(path.read_text()))
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    else:
        if spec.preset not in PRESETS:
            raise ValueError(
                f"unknown model preset {spec.preset!r}; known presets: {', '.join(PRESETS)}"
            )
        base = PRESETS[spec.preset]
    return apply_overrides(base, spec.overrides)


def check_tensor_parallel(config: LlamaConfig, tp: int, ranks: int | None = None) -> None:
    """InvalidInput unless ``tp`` divides the ranks, the heads, the KV heads and the MLP width."""
    if tp < 1:
        raise InvalidInput(f"tensor_parallel is {tp}; it must be at least 1.")
    if ranks is not None and ranks % tp:
        raise InvalidInput(
            f"tensor_parallel {tp} does not divide the site's {ranks} ranks; choose a divisor."
        )
    for what, value in (("num_attention_heads", config.num_attention_heads),
                        ("num_key_value_heads", config.num_key_value_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise InvalidInput(
                f"tensor_parallel {tp} does not divide the model's {what} ({value}); "
                "choose a divisor."
            )


def linear_modules(config: LlamaConfig) -> list[str]:
    """The names of every nn.Linear in xffl's LLaMA of ``config`` (what LoRA can target)."""
    names = [f"model.layers.{i}.{block}.{proj}"
             for i in range(config.num_hidden_layers)
             for block, projs in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                  ("mlp", ("gate_proj", "up_proj", "down_proj")))
             for proj in projs]
    return [*names, "lm_head"]
