"""LoRA through peft: the round-0 adapter, a site's adapted model, and its adapter tensors.

The base model stays frozen everywhere; what travels and is aggregated is the adapter, named
as peft saves it (:mod:`xffl.aggregator.adapter`). The coordinator writes round 0's adapter
itself (A drawn from peft's distribution, Kaiming-uniform with ``a = sqrt(5)``, by the rule of
every seeded round-0 tensor, :mod:`xffl.training.seeded`: from the job's seed, the tensor's
name and position, so that it does not depend on the order of peft's module walk; B zero,
so the adapted model starts as the base model), and every site loads the round's global
adapter into a peft model of its base. With ``freeze_a`` the A
factors are not trained: every site keeps the seeded A, and the aggregate of the products
B·A is the product of the aggregated B and that A.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from xffl.aggregator.adapter import factor_names
from xffl.aggregator.exchange import Manifest, finalize_manifest, staged_dir
from xffl.aggregator.kinds import LORA_ADAPTER
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.training.arch import ModelConfig, build_config
from xffl.training.config import LoraSpec, ModelSpec
from xffl.training.entry import build
from xffl.training.seeded import TensorInit, seeded_tensor

if TYPE_CHECKING:  # the coordinator imports this module: no torch.distributed at import
    from xffl.training.parallelize import ParallelModel


def peft_config(spec: LoraSpec, base: str | None = None) -> Any:
    """peft's LoraConfig for ``spec`` (``base``: the base model's path, for the record)."""
    from peft import LoraConfig

    # peft types lora_alpha as an int (and writes it so); a fractional alpha works as well
    alpha: Any = int(spec.alpha) if spec.alpha.is_integer() else spec.alpha
    return LoraConfig(r=spec.r, lora_alpha=alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), bias="none",
                      base_model_name_or_path=base)


def adapter_config_json(spec: LoraSpec, base: str | None = None) -> str:
    """adapter_config.json as peft's ``save_pretrained`` writes it (sets as lists)."""
    data = peft_config(spec, base).to_dict()
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def adapted_linears(model: nn.Module, spec: LoraSpec) -> dict[str, nn.Linear]:
    """The nn.Linear modules of ``model`` that ``spec`` targets, by name (peft's rule)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and spec.matches(name)}


def initial_adapter(config: ModelConfig, entry_point: str | None, spec: LoraSpec,
                    seed: int) -> dict[str, Tensor]:
    """Round 0's adapter tensors: A seeded Kaiming-uniform (peft's init), B zero.

    The model is built on the meta device, so no weight of a large base is allocated.
    """
    with torch.device("meta"):
        net = build(config, entry_point)
    linears = adapted_linears(net, spec)
    if not linears:
        kinds = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules()
                        if isinstance(m, nn.Linear)})
        raise InvalidInput(f"training.lora.target_modules {spec.target_modules} match no "
                           f"linear layer of the model; its linear layers are "
                           f"{', '.join(kinds) or 'none'}.")
    tensors: dict[str, Tensor] = {}
    for module, linear in sorted(linears.items()):
        a_name, b_name = factor_names(module)
        # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
        bound = 1 / math.sqrt(linear.in_features)
        tensors[a_name] = seeded_tensor(seed, TensorInit(
            a_name, (spec.r, linear.in_features), "uniform", bound))
        tensors[b_name] = torch.zeros(linear.out_features, spec.r, dtype=torch.float32)
    return tensors


def save_adapter(tensors: Mapping[str, Tensor], adapter_config: str, out_dir: Path,
                 manifest: Manifest) -> Manifest:
    """Write adapter_model.safetensors, adapter_config.json and manifest.json atomically."""
    with staged_dir(Path(out_dir)) as tmp:
        save_file(dict(tensors), str(tmp / LORA_ADAPTER.tensor_file), metadata={"format": "pt"})
        (tmp / LORA_ADAPTER.config_file).write_text(adapter_config)
        return finalize_manifest(tmp, manifest)


def wrap(model: nn.Module, spec: LoraSpec, freeze_a: bool) -> nn.Module:
    """``model`` as a peft model with ``spec``'s adapter; only the adapter is trainable."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft's PeftModel reads transformers' deprecated ``is_gradient_checkpointing`` (its
        # own code, not a call of xffl's): one FutureWarning per rank and round in every
        # LoRA site's log, about nothing the user can change; only that warning is hidden
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        peft_model: nn.Module = get_peft_model(model, peft_config(spec))
    for name, param in peft_model.named_parameters():
        param.requires_grad_(is_adapter_param(name) and not (freeze_a and ".lora_A." in name))
    return peft_model


def _check_adapter(own: Mapping[str, Tensor], tensors: Mapping[str, Tensor],
                   where: Path) -> None:
    """The global adapter ``tensors`` has every factor of the model's (``own``), shaped
    alike, and nothing else; CheckpointError naming ``where`` otherwise."""
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{where}: the adapter does not fit the model: missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}.")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(own[name].shape):
            raise CheckpointError(f"{where}: adapter tensor {name} has shape "
                                  f"{tuple(value.shape)}, the model expects "
                                  f"{tuple(own[name].shape)}.")


def load_adapter(peft_model: nn.Module, tensors: Mapping[str, Tensor], where: Path) -> None:
    """Put a global adapter's tensors into ``peft_model``; every factor must be given.

    With ``lm_head`` (or ``embed_tokens``) among the targets peft's state dict would also
    hold that layer's whole base weight (``save_embedding_layers="auto"``); the base is
    frozen and never travels, so the adapter is its factors alone, here and in
    :func:`adapter_state`.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    _check_adapter(get_peft_model_state_dict(peft_model, save_embedding_layers=False),
                   tensors, where)
    set_peft_model_state_dict(peft_model, dict(tensors))


def frozen_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The frozen base's dtype: bf16 where the round computes in bf16 (``precision`` bf16,
    or auto on a GPU), else fp32. The adapter stays fp32 (peft's ``autocast_adapter_dtype``)."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def base_checkpoint_name(key: str) -> str:
    """The base checkpoint's name of a peft model's state-dict key: peft nests the model
    under ``base_model.model.`` and an adapted layer's own weight under ``base_layer``."""
    return key.removeprefix("base_model.model.").replace(".base_layer.", ".")


def load_sliced_adapted(base_dir: Path, adapter_dir: Path, config: ModelConfig,
                        spec: LoraSpec, freeze_a: bool, device: torch.device,
                        data_parallel: str, checkpointing: int = 0,
                        dtype: torch.dtype = torch.float32, *, precision: str = "auto",
                        compile: bool = False, shard_group: int | None = None
                        ) -> ParallelModel:
    """The frozen base in ``base_dir`` (``dtype``) with the global adapter in ``adapter_dir``
    (fp32), sharded over the ranks' mesh as the full model is (:mod:`sharded_load`).

    peft wraps the model on the meta device, so the decoder layers FSDP2 shards hold their
    LoRA factors; every rank then reads one tensor at a time into its slices: no rank ever
    holds the whole base.
    """
    from peft import get_peft_model_state_dict

    from xffl.training.checkpoint import read_weights
    from xffl.training.sharded_load import load_sliced, meta_causal_lm

    peft_model = wrap(meta_causal_lm(config, dtype), spec, freeze_a)
    tensors = read_weights(adapter_dir)  # the adapter: small, read whole
    keys = peft_model.state_dict(keep_vars=True)
    # peft's own names of the factors (its adapter name dropped), matched by the parameter
    # objects: the adapter's tensors keyed by the model's state-dict keys
    own = get_peft_model_state_dict(peft_model, state_dict=keys, save_embedding_layers=False)
    _check_adapter(own, tensors, adapter_dir)
    by_param = {id(value): name for name, value in own.items()}
    given = {key: tensors[by_param[id(value)]] for key, value in keys.items()
             if id(value) in by_param}
    # activation checkpointing, compilation and FSDP2 reach the decoder layers through peft
    return load_sliced(peft_model, base_dir, 1, device, data_parallel, base_checkpoint_name,
                       given, checkpointing=checkpointing, precision=precision,
                       compile=compile, shard_group=shard_group)


def adapter_state(peft_model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The adapter's tensors, named as peft saves them, out of a full state dict of
    ``peft_model`` (its module names): the factors only, never a base weight."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(peft_model, state_dict=dict(state),
                                                  save_embedding_layers=False).items()}


def is_adapter_param(name: str) -> bool:
    """Whether a peft model's parameter (or state-dict key) belongs to the adapter."""
    return ".lora_A." in name or ".lora_B." in name


def init_adapter_global(run_id: str, model: ModelSpec, spec: LoraSpec, seed: int,
                        out_dir: Path, base: str) -> Manifest:
    """Write round 0's global adapter (``base``: the frozen base model's folder, recorded
    in adapter_config.json as peft records it)."""
    config = build_config(model)
    tensors = initial_adapter(config, model.entry_point, spec, seed)
    manifest = Manifest(kind="global", run_id=run_id, round=0, extra={
        "lora": spec.model_dump(mode="json"), "seed": seed, "base": base,
        "num_parameters": sum(t.numel() for t in tensors.values())})
    return save_adapter(tensors, adapter_config_json(spec, base), out_dir, manifest)
