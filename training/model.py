"""The model: transformers' ``AutoModelForCausalLM`` of the config's family, fp32 on the CPU.

Nothing here knows about parallelism (:mod:`xffl.training.parallelize` applies the family's
tensor-parallel plan and data parallelism from the outside, as torchtitan does). A model
built here returns its logits from ``model(input_ids)`` (a forward hook takes them out of
transformers' output), so the training loop and the evaluator treat every model, a user's
``model.entry_point`` module included, the same way; given ``loss_targets``, it returns the
summed token loss instead, with the LM head applied chunk by chunk
(:mod:`xffl.training.chunked_loss`).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xffl.training import chunked_loss
from xffl.training.arch import PRESETS, ModelConfig, apply_overrides, build_config
from xffl.training.seeded import TensorInit, seeded_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "PRESETS",
    "ModelConfig",
    "apply_overrides",
    "build_config",
    "build_model",
    "export_state_dict",
    "from_config",
    "linear_modules",
    "lm_loss",
    "lm_loss_sum",
    "load_pretrained",
    "load_weights",
    "meta_model",
    "model_layout",
    "needs_conversion",
    "num_parameters",
    "prepare",
    "uniform_loss",
]


def _logits(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: a transformers output becomes its logits tensor."""
    return getattr(output, "logits", output)


def prepare(model: PreTrainedModel) -> PreTrainedModel:
    """No KV cache in training, logits out of forward; the chunked loss in forward when asked
    (``model(ids, loss_targets=t)``, :mod:`xffl.training.chunked_loss`)."""
    model.config.use_cache = False
    model.register_forward_hook(_logits)
    chunked_loss.install(model)
    return model


def from_config(config: ModelConfig) -> PreTrainedModel:
    """transformers' model of the family, fp32, with a config object of its own (training
    changes ``use_cache`` in it); built on whatever device is the default."""
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        copy.deepcopy(config.hf), dtype=torch.float32)
    return model


def meta_model(config: ModelConfig) -> PreTrainedModel:
    """The family's model on the meta device: names, shapes and module types, no memory."""
    with torch.device("meta"):
        return from_config(config)


def num_parameters(config: ModelConfig) -> int:
    """Number of parameters (a tied head counted once), from the meta-device model."""
    return sum(p.numel() for p in meta_model(config).parameters())


def linear_modules(config: ModelConfig) -> list[str]:
    """The names of every nn.Linear of the model of ``config`` (what LoRA can target)."""
    return [name for name, m in meta_model(config).named_modules() if isinstance(m, nn.Linear)]


def _family_constant(model: nn.Module, name: str) -> float | None:
    """The value transformers' own init gives the 1-D parameter ``name`` when it is constant.

    Norm weights are ones in most families and zeros where the norm scales by ``1 + w``
    (Gemma); the family's ``_init_weights`` on a CPU copy of the (small) owning module says
    which, so no family is hard-coded here.
    """
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if any(p.dim() != 1 for p in owner.parameters(recurse=False)):
        return None
    probe = copy.deepcopy(owner).to_empty(device="cpu")
    with torch.no_grad():
        for p in probe.parameters(recurse=False):
            p.fill_(math.nan)
    with torch.random.fork_rng(devices=[]):
        model._init_weights(probe)  # type: ignore[operator]
    values = dict(probe.named_parameters(recurse=False))[attr].detach()
    if torch.isnan(values).any() or not bool((values == values[0]).all()):
        return None
    return float(values[0])


def model_layout(config: ModelConfig) -> list[TensorInit]:
    """How round 0 initialises every tensor of the checkpoint, in safetensors' name order.

    Matrices (and expert stacks) are N(0, initializer_range); biases zeros; norm weights the
    family's constant (see :func:`_family_constant`). The tied LM head is not a tensor of its own.
    """
    model = meta_model(config)
    std = config.initializer_range
    out = []
    for name, param in sorted(model.state_dict().items()):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shape = tuple(param.shape)
        if param.dim() == 1:
            value = 0.0 if name.endswith(".bias") else _family_constant(model, name)
            out.append(TensorInit(name, shape, "constant", 1.0 if value is None else value))
        else:
            out.append(TensorInit(name, shape, "normal", std))
    return out


@contextmanager
def _no_init() -> Iterator[None]:
    """transformers builds without its random init (the weights are set right after)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        yield


def build_model(config: ModelConfig, seed: int | None = None) -> PreTrainedModel:
    """A float32 model on the CPU, with round 0's seeded weights when ``seed`` is given."""
    if seed is None:  # transformers' own (unseeded) init
        return prepare(from_config(config))
    with _no_init():
        model = from_config(config)
    model.tie_weights()  # transformers ties in the init that _no_init skips
    tensors = {init.name: seeded_tensor(seed, init) for init in model_layout(config)}
    load_weights(model, tensors)
    return prepare(model)


def load_pretrained(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A checkpoint folder's model through transformers (meta build, tensor-by-tensor load),
    its weights in ``dtype``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a site's log is read by people: no bars per load
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, local_files_only=True, trust_remote_code=False)
    return prepare(model)


def warm_imports(model_dir: Path) -> None:
    """Import the transformers code that loading and training ``model_dir``'s model runs.

    No tensors, no threads: the forked launcher calls it once, before the ranks are forked,
    so that they do not each import it again (about 1.5 s of CPU per rank).
    """
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    warm_family(model_type)


def warm_family(model_type: object) -> None:
    """Import the transformers code a model of ``model_type`` (config.json's) loads and
    trains with: the loading and masking modules, and the family's modeling module when
    transformers knows the type; and build transformers' table of checkpoint renamings.

    The table (every family's weight renamings, about 900 regular expressions compiled) is
    built at the first ``from_pretrained`` of a process and kept for the next: built here, a
    rank forked from this process skips it (0.15 CPU-s of a tiny model's 0.3-s round).
    """
    import transformers
    import transformers.initialization
    import transformers.masking_utils
    import transformers.modeling_utils
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    get_checkpoint_conversion_mapping(str(model_type))  # type: ignore[no-untyped-call]

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) \
        else None
    if name is not None:
        getattr(transformers, name)  # the family's modeling module


def needs_conversion(model_dir: Path, config: ModelConfig) -> bool:
    """Whether ``model_dir``'s tensor names are not the model's but transformers converts
    them on load (Mixtral's per-expert ``block_sparse_moe.experts.N.w1`` into fused stacks)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from xffl.aggregator.shards import open_model

    if get_checkpoint_conversion_mapping(config.model_type) is None:  # type: ignore[no-untyped-call]
        return False
    expected = set(meta_model(config).state_dict())
    with open_model(model_dir) as reader:
        return not set(reader.names()) <= expected


def export_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """HF-named fp32 contiguous CPU tensors, ready for safetensors (tied head dropped)."""
    state = {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in model.state_dict().items()
    }
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
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
    """Mean next-token cross-entropy; ``targets`` are the inputs shifted left by one (a
    target of -100, out of the loss, is skipped)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def lm_loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """The sum of the next-token cross-entropies of the targets in the loss (not -100), from
    whole logits (the chunked path: :func:`xffl.training.chunked_loss.loss_sum`)."""
    return chunked_loss.full_logits_loss(logits, targets)


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a uniform prediction (what an untrained model scores)."""
    return math.log(vocab_size)
