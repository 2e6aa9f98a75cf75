"""A checkpoint loaded into a model already split over its mesh, one tensor at a time.

With tensor parallelism or FSDP2 a rank holds only its slices, so it should never hold the
whole model, not even while loading. As torchtitan does, the model is built on the meta
device, parallelized there (the plan and ``fully_shard`` need only shapes), materialized
empty (each rank allocates its slices), and then every tensor of the checkpoint is read
alone (safetensors, memory-mapped) and cut to this rank's slices by
``distribute_tensor(..., src_data_rank=None)``: every rank reads the same file, so nothing is
sent. A rank's peak is its slices plus the largest single tensor. Non-persistent buffers
(rotary tables) are recomputed by the family's own ``_init_weights``. A LoRA site loads its
frozen base this way too, wrapped by peft on the meta device first
(:func:`xffl.training.lora.load_sliced_adapted`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from xffl.aggregator.shards import open_model
from xffl.core.errors import CheckpointError
from xffl.training.arch import ModelConfig
from xffl.training.model import meta_model, prepare
from xffl.training.parallelize import ParallelModel, is_dtensor, parallelize

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _restore_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers ``to_empty`` left undefined (rotary tables)."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if module._non_persistent_buffers_set and not list(module.parameters(recurse=False)):
            if init is None:
                raise CheckpointError(f"cannot recompute the buffers of {type(module).__name__}")
            with torch.no_grad():
                init(module)


def meta_causal_lm(config: ModelConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The family's model on the meta device, its parameters in ``dtype`` (buffers, as the
    rotary tables, keep theirs), ready for training. No memory is allocated."""
    model = prepare(meta_model(config))
    for param in model.parameters():  # tied parameters stay one object
        param.data = param.data.to(dtype)
    return model


def load_sliced(model: nn.Module, model_dir: Path, tp: int, device: torch.device,
                data_parallel: str, checkpoint_name: Callable[[str], str] = str,
                given: Mapping[str, Tensor] | None = None, *, checkpointing: int = 0,
                precision: str = "auto", compile: bool = False,
                shard_group: int | None = None, groups: int = 1) -> ParallelModel:
    """A meta-device ``model`` split over the (dp, tp) mesh of all ranks, its slices filled
    one tensor at a time: a state-dict entry from ``given`` (by the model's key) when there,
    else from the checkpoint in ``model_dir``, whose tensor ``checkpoint_name(key)`` it is.
    For meshes whose ranks hold slices (FSDP2, tensor parallel): DDP would wrap the model
    before its weights exist. ``checkpointing``, ``precision``, ``compile``, ``shard_group``,
    ``groups``: as :func:`parallelize` takes them."""
    from torch.distributed.tensor import distribute_tensor

    pm = parallelize(model, tp, device, data_parallel, precision=precision,
                     checkpointing=checkpointing, compile=compile, shard_group=shard_group,
                     groups=groups)
    pm.module.to_empty(device=device)
    _restore_buffers(pm.module)
    tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings",
                                         False) else set()
    model_dir = Path(model_dir)
    given = given or {}
    with open_model(model_dir) as reader, torch.no_grad():
        names = set(reader.names())
        for key, param in pm.module.state_dict(keep_vars=True).items():
            name = checkpoint_name(key)
            if key in given:
                full = given[key].to(device=device, dtype=param.dtype)
            elif name in names:
                full = torch.from_numpy(reader.read(name)).to(device=device, dtype=param.dtype)
            elif name in tied:
                continue
            else:
                raise CheckpointError(f"{model_dir}: no tensor {name} in the checkpoint.")
            if tuple(full.shape) != tuple(param.shape):
                raise CheckpointError(f"{model_dir}: tensor {name} has shape "
                                      f"{tuple(full.shape)}, the model expects "
                                      f"{tuple(param.shape)}.")
            if is_dtensor(param):
                part = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)
            del full
    return pm


def load_parallel(model_dir: Path, config: ModelConfig, tp: int, device: torch.device,
                  data_parallel: str, checkpointing: int = 0, *, precision: str = "auto",
                  compile: bool = False, shard_group: int | None = None,
                  groups: int = 1) -> ParallelModel:
    """The checkpoint in ``model_dir`` as a model split over the (dp, tp) mesh of all ranks
    (``checkpointing``, ``precision``, ``compile``, ``shard_group``, ``groups``: as
    :func:`parallelize` takes them)."""
    return load_sliced(meta_causal_lm(config), model_dir, tp, device, data_parallel,
                       checkpointing=checkpointing, precision=precision, compile=compile,
                       shard_group=shard_group, groups=groups)
