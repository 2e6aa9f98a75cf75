"""A causal LM's architecture: a Hugging Face config.json of any family transformers knows.

xffl trains ``transformers.AutoModelForCausalLM`` models. :class:`ModelConfig` wraps the
config.json fields (``model_type`` first), checks them through transformers' own config class
of the family, and answers the few numbers xffl needs (vocabulary, longest sequence, heads
for tensor-parallel divisibility). The presets are configs only, no weights. transformers is
imported where a config is checked, not when this module is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xffl.core.errors import InvalidInput
from xffl.training.config import ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The version of the seeded initialisation (training.seeded): cached initial models
# (xffl.workflows.plan.init_cache) are keyed by it. Bump it whenever that code changes.
INIT_VERSION = 3

# The tensor-parallel styles of transformers' plans (config.base_model_tp_plan) xffl applies
# with torch.distributed.tensor.parallel; any other style in a plan refuses tensor_parallel > 1.
SUPPORTED_TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def _refusal(exc: Exception) -> str:
    """The reason in transformers' error, one line (its validators nest the cause last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else type(exc).__name__
    return text.removeprefix("ValueError: ").rstrip(".")


def _transformers_version() -> str:
    """The installed transformers' version (for messages)."""
    import transformers

    return str(transformers.__version__)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters: the fields of a Hugging Face config.json."""

    fields: dict[str, Any] = field(compare=True)

    @cached_property
    def hf(self) -> PretrainedConfig:
        """transformers' config object of the family (checked: ValueError if it refuses).

        transformers' own warnings about a config stay quiet: xffl's checks speak for it,
        in one line with the file and the field.
        """
        from transformers import AutoConfig
        from transformers.utils import logging

        data = dict(self.fields)
        model_type = data.pop("model_type")
        level = logging.get_verbosity()
        logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        try:
            return AutoConfig.for_model(model_type, **data)
        finally:
            logging.set_verbosity(level)

    @property
    def model_type(self) -> str:
        """The family (``llama``, ``qwen2``, ``mistral``, ``gemma2``, ``mixtral``, ...)."""
        return str(self.fields["model_type"])

    def _field(self, name: str) -> Any:
        """A config value: the config.json's own when given, else the family's default
        (which needs transformers, and so torch: a preset answers without them)."""
        if name in self.fields:
            return self.fields[name]
        return getattr(self.hf, name, None)

    def _int(self, name: str) -> int:
        value = self._field(name)
        return int(value) if value is not None else 0

    @property
    def vocab_size(self) -> int:
        """Vocabulary size."""
        return self._int("vocab_size")

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return self._int("hidden_size")

    @property
    def intermediate_size(self) -> int:
        """Width of the MLP (of one expert, in a mixture of experts)."""
        return self._int("intermediate_size")

    @property
    def num_hidden_layers(self) -> int:
        """Number of decoder layers."""
        return self._int("num_hidden_layers")

    @property
    def num_attention_heads(self) -> int:
        """Query heads."""
        return self._int("num_attention_heads")

    @property
    def num_key_value_heads(self) -> int:
        """Key/value heads (grouped-query attention); the query heads when not set."""
        return self._int("num_key_value_heads") or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Size of one attention head (the config's own, else hidden / heads)."""
        return self._int("head_dim") or self.hidden_size // max(self.num_attention_heads, 1)

    @property
    def max_position_embeddings(self) -> int:
        """The longest sequence the model takes."""
        return self._int("max_position_embeddings")

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the LM head shares the embedding's weight."""
        return bool(self._field("tie_word_embeddings"))

    @property
    def initializer_range(self) -> float:
        """Standard deviation of the seeded initialisation of matrices."""
        return float(self._field("initializer_range") or 0.02)

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """The family's tensor-parallel plan (module pattern -> style), if transformers has one."""
        plan = getattr(self.hf, "base_model_tp_plan", None)
        return dict(plan) if plan else None

    def validate(self) -> None:
        """Raise ValueError when the numbers do not describe a buildable model."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self._int("head_dim") and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be "
                             f"divisible by num_key_value_heads ({self.num_key_value_heads})")

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json transformers writes for this model (fp32 weights)."""
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        data: dict[str, Any] = self.hf.to_dict()
        data["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[self.model_type]]
        data["dtype"] = "float32"
        data.pop("_name_or_path", None)
        data.pop("transformers_version", None)
        return data

    def to_json(self) -> str:
        """:meth:`to_hf_dict` as the text of a config.json (keys sorted: one byte form)."""
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json; ValueError naming what transformers cannot build."""
        model_type = data.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError("model_type is missing; a Hugging Face config.json names its "
                             "family (llama, qwen2, mistral, ...)")
        from transformers.models.auto.configuration_auto import (  # type: ignore[attr-defined]
            CONFIG_MAPPING_NAMES,
        )
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            raise ValueError(f"model_type {model_type!r} is not a model family transformers "
                             f"{_transformers_version()} knows; upgrade transformers or use a "
                             "checkpoint of a known family")
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"model_type {model_type!r} has no causal language model class "
                             "in transformers; xffl trains AutoModelForCausalLM models")
        config = cls(fields={k: v for k, v in data.items()
                             if k not in ("_name_or_path", "transformers_version")})
        try:
            config.hf  # noqa: B018 (transformers checks the fields)
        except Exception as exc:  # its validators raise their own error types
            raise ValueError(f"transformers refuses the {model_type} config: "
                             f"{_refusal(exc)}") from exc
        config.validate()
        return config


def _tiny(model_type: str, **extra: Any) -> ModelConfig:
    """A byte-vocabulary test model of ``model_type`` (GQA: 4 heads over 2 kv heads)."""
    fields: dict[str, Any] = {
        "model_type": model_type, "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "initializer_range": 0.02}
    fields.update(extra)
    return ModelConfig(fields)


def _llama(**fields: Any) -> ModelConfig:
    """A LLaMA-family preset (SiLU MLP, RMSNorm, rotary embeddings)."""
    return ModelConfig({"model_type": "llama", "tie_word_embeddings": False,
                        "initializer_range": 0.02, "rms_norm_eps": 1e-5, **fields})


PRESETS: dict[str, ModelConfig] = {
    # Quickstart: byte-level LLaMA, ~0.12 M parameters; trains visibly in seconds on a CPU core.
    "tiny": _llama(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    # Unit tests: as small as possible while still exercising GQA (4 heads over 2 kv heads).
    "tiny-test": _llama(vocab_size=256, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=128),
    # One tiny model per family the tests train (the families' own features kept on).
    "tiny-llama3": _tiny("llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "tiny-qwen2": _tiny("qwen2", tie_word_embeddings=True),  # q/k/v biases, tied embeddings
    "tiny-qwen3": _tiny("qwen3"),  # q/k norms
    "tiny-mistral": _tiny("mistral"),
    "tiny-gemma2": _tiny("gemma2", tie_word_embeddings=True),  # soft-capping, (1 + w) norms
    "tiny-mixtral": _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2),
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": _llama(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": _llama(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": ModelConfig({
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643}),
    # mistralai/Mistral-7B-v0.3
    "mistral-7b": ModelConfig({
        "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "bos_token_id": 1, "eos_token_id": 2}),
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


def known_fields(config: ModelConfig) -> list[str]:
    """The scalar config.json fields an override may replace (the family's own)."""
    data = config.hf.to_dict()
    return sorted(k for k, v in data.items()
                  if isinstance(v, (int, float, bool)) and not k.startswith("_")
                  and k not in ("transformers_version",))


def apply_overrides(
    config: ModelConfig, overrides: Mapping[str, int | float | bool]
) -> ModelConfig:
    """A copy of ``config`` with config.json fields replaced; ValueError naming unknown keys."""
    if not overrides:
        return config
    current = config.hf.to_dict()
    fields = known_fields(config)
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(
                f"unknown model override {key!r}; known fields: {', '.join(fields)}")
        changes[key] = _coerce(key, current[key], value)
    new = ModelConfig({**config.fields, **changes})
    try:
        new.hf  # noqa: B018 (transformers checks the new values)
    except Exception as exc:  # its validators raise their own error types
        raise ValueError(f"transformers refuses the overrides: {_refusal(exc)}") from exc
    new.validate()
    return new


def build_config(spec: ModelSpec) -> ModelConfig:
    """The ModelConfig a ModelSpec describes: preset (or ``init``'s config.json) plus overrides."""
    if spec.init is not None:
        path = Path(spec.init) / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a JSON object")
        base = ModelConfig.from_hf_dict(data)
    else:
        if spec.preset not in PRESETS:
            raise ValueError(
                f"unknown model preset {spec.preset!r}; known presets: {', '.join(PRESETS)}"
            )
        base = PRESETS[spec.preset]
    return apply_overrides(base, spec.overrides)


def check_tensor_parallel(config: ModelConfig, tp: int, ranks: int | None = None) -> None:
    """InvalidInput unless the family has a plan xffl applies and ``tp`` divides its widths."""
    if tp < 1:
        raise InvalidInput(f"tensor_parallel is {tp}; it must be at least 1.")
    if ranks is not None and ranks % tp:
        raise InvalidInput(
            f"tensor_parallel {tp} does not divide the site's {ranks} ranks; choose a divisor."
        )
    if tp == 1:
        return
    plan = config.tp_plan
    if plan is None:
        raise InvalidInput(
            f"model family {config.model_type!r} has no tensor-parallel plan in transformers "
            f"{_transformers_version()}; set training.tensor_parallel: 1 (data parallel, "
            "FSDP2 shards the model across ranks).")
    other = sorted({s for s in plan.values() if s not in SUPPORTED_TP_STYLES})
    if other:
        raise InvalidInput(
            f"model family {config.model_type!r} splits layers with {', '.join(other)} "
            "(mixture-of-experts or packed weights), which xffl does not apply; set "
            "training.tensor_parallel: 1 (data parallel, FSDP2 shards the model).")
    for what, value in (("num_attention_heads", config.num_attention_heads),
                        ("num_key_value_heads", config.num_key_value_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise InvalidInput(
                f"tensor_parallel {tp} does not divide the model's {what} ({value}); "
                "choose a divisor."
            )
