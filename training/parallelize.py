"""Parallelize a causal LM over a (dp, tp) device mesh: the family's tensor plan, then DP.

As in torchtitan, the model (:mod:`xffl.training.model`) knows nothing of parallelism: this
module applies the family's own tensor-parallel plan (transformers' ``base_model_tp_plan``:
Megatron's, with q/k/v and gate/up projections column-wise, o and down projections row-wise,
so each attention and each MLP block costs one all-reduce in forward) with torch's parallel
styles from ``torch.distributed.tensor.parallel`` on the ``tp`` dimension (per-head norms
that the plan keeps replicated, as Qwen3's and Gemma 3's q/k norms, take torch's
``SequenceParallel`` over the head dimension, which all-reduces their gradients), then data
parallelism on the ``dp`` dimension: DDP, or FSDP2 (``fully_shard``, per decoder layer then
the root) for models that do not fit replicated and whenever tp > 1 (torch's DDP turns
tensor-parallel parameters into plain attributes after the first forward, so it does not
compose with DTensor parameters). Embeddings, norms and the LM head stay replicated on tp.
Ranks are laid out with tp innermost, so the ranks of one tensor-parallel group are
consecutive (on one node, where SLURM and torchrun place consecutive ranks). HSDP with
tensor parallelism is torchtitan's 3-D mesh (replicate, shard, tp): the plan on ``tp``,
FSDP2 on the 2-D (replicate, shard) sub-mesh, tp innermost and a shard group's ranks next.

Memory, as torchtitan's ``parallelize_llama`` does it: tensor parallelism first, then
activation checkpointing of every k-th decoder layer (torch's composable ``checkpoint``;
the names stay Hugging Face's), then ``torch.compile`` per decoder layer (optional),
then FSDP2. Under bf16 FSDP2 gets ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the sharded master weights, their gradients and the optimizer states
stay fp32, the gathered weights and the activations are bf16, gradients are reduced in fp32,
and no autocast runs around the forward (its cast cache would keep a bf16 copy of every
unsharded weight). DDP and a single process keep fp32 weights under bf16 autocast.

``torch.distributed.tensor`` (DTensor, FSDP2, the tensor-parallel styles, distributed
checkpoint) costs 1.3 s of CPU to import. transformers' model code imports it anyway, so
only a ``model.entry_point`` model on one rank goes without it: this module imports it where
FSDP2, tensor parallelism or a mesh's state dict needs it. (With a process group, torch's
DDP constructor imports ``torch._dynamo``, which loads it too.) No object can be a DTensor
or an FSDP module before that module is loaded, which is what :func:`is_dtensor` and
:func:`is_fsdp` rely on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from xffl.core.errors import InvalidInput
from xffl.training.arch import ModelConfig, check_tensor_parallel
from xffl.training.memory_model import fsdp_threshold

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ParallelModel", "apply_checkpointing", "check_tensor_parallel", "data_parallel_mode",
           "decoder_layers", "device_memory", "fsdp_threshold", "hsdp_mesh", "layer_plan",
           "parallelize",
           "uses_bf16"]

MESH_DIMS = ("dp", "tp")
LAYER_PATTERN = "layers.*."  # how transformers' plans name a module of every decoder layer


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (False while torch.distributed.tensor was never imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def is_fsdp(m: object) -> bool:
    """Whether ``m`` was sharded by FSDP2 (False while its module was never imported)."""
    mod = sys.modules.get("torch.distributed.fsdp")
    return mod is not None and isinstance(m, mod.FSDPModule)


def layer_plan(plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """transformers' plan (``layers.*.self_attn.q_proj: colwise``, ...) for one decoder
    layer, in torch.distributed.tensor.parallel styles (styles checked by
    :func:`~xffl.training.arch.check_tensor_parallel`)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if not pattern.startswith(LAYER_PATTERN):
            raise InvalidInput(f"tensor-parallel plan entry {pattern!r} is outside the decoder "
                               "layers; set training.tensor_parallel: 1.")
        name = pattern[len(LAYER_PATTERN):]
        if style == "colwise":
            out[name] = ColwiseParallel()
        elif style == "rowwise":
            out[name] = RowwiseParallel()
        else:  # replicated_with_grad_allreduce: a per-head norm after a column-wise projection
            out[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers``), also through
    a peft model (``get_base_model()``: the transformers model it adapts), else []."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):  # peft's PeftModel: its LoRA layers sit inside these layers
        model = get_base_model()
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of a transformers model (None for a model.entry_point module)."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None or not decoder_layers(model):
        return None
    return ModelConfig(to_dict())


DataParallel = Literal["auto", "ddp", "fsdp", "hsdp"]
HSDP_DIMS = ("replicate", "shard")


def uses_bf16(precision: str, device: torch.device) -> bool:
    """Whether ``precision`` means bf16 compute on ``device``: "bf16", or "auto" on CUDA."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory of a CUDA device (None for any other device)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def data_parallel_mode(requested: str, tp: int, params: int = 0,
                       memory: int | None = None) -> Literal["ddp", "fsdp"]:
    """The data-parallel wrapper to use. "auto": FSDP2 when tp > 1 or the model is large
    (``params`` at or over :func:`fsdp_threshold` of the GPU's ``memory``), else DDP; "hsdp"
    is FSDP2 too (on a 2-D mesh, or 3-D with tensor parallelism: :func:`hsdp_mesh`)."""
    if requested == "ddp" and tp > 1:
        raise InvalidInput(
            "training.data_parallel ddp cannot be combined with tensor_parallel > 1 in torch; "
            "use data_parallel: fsdp (or auto)."
        )
    if requested == "auto":
        return "fsdp" if tp > 1 or params >= fsdp_threshold(memory) else "ddp"
    if requested not in ("ddp", "fsdp", "hsdp"):
        raise InvalidInput(f"training.data_parallel {requested!r}: use auto, ddp, fsdp or hsdp.")
    return "ddp" if requested == "ddp" else "fsdp"


@dataclass
class ParallelModel:
    """A model wrapped for training on a (dp, tp) mesh, and what the loop needs to know of it."""

    module: nn.Module  # the model itself (FSDP2/TP turn its parameters into DTensors)
    net: nn.Module  # what to call in forward: DDP(module), or module
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    mesh: DeviceMesh | None = None
    groups: int = 1  # training.local_groups: dp ranks split into this many groups

    @property
    def group(self) -> int:
        """This rank's local group (0 without groups): dp ranks in blocks of dp/groups."""
        return self.dp_rank // (self.dp_size // self.groups)

    @contextmanager
    def _fsdp_no_sync(self) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        module = self.module
        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip the dp gradient reduction (for all but the last micro-batch of a step).

        DDP skips it (its gradients are whole on every rank anyway). FSDP2 at dp > 1 does
        not: skipping would keep every layer's unsharded fp32 gradient until the last
        micro-batch (DDP's gradient memory); reduce-scattering each micro-batch keeps only
        this rank's 1/dp shard. At dp 1 a shard is the whole (tp-local) gradient, so the
        unsharded one costs no more memory and skipping saves a copy per micro-batch.
        """
        if isinstance(self.net, DistributedDataParallel):
            return self.net.no_sync()
        if is_fsdp(self.module) and self.dp_size // self.groups == 1:
            return self._fsdp_no_sync()
        return nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip gradients by the 2-norm of the whole (unsplit) model's gradient; return it.

        torch's clip_grad_norm_ cannot stack norms of DTensors on different meshes (tensor-
        parallel weights live on the 2-D mesh, replicated ones on dp only), so the squared
        norm is summed per mesh, each group's made whole with ``full_tensor()``.
        """
        groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
        for p in self.module.parameters():
            if p.grad is not None:
                mesh = p.grad.device_mesh if is_dtensor(p.grad) else None  # type: ignore[attr-defined]
                groups.setdefault(mesh, []).append(p)
        squares: list[Tensor] = []
        for params in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            if is_dtensor(norm):
                norm = norm.full_tensor()  # type: ignore[attr-defined]
            squares.append(norm.float() ** 2)
        if not squares:
            return torch.zeros(())
        total = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_state_dict(self, keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
        """Hugging Face-named full fp32 CPU tensors on rank 0 ({} elsewhere); collective.

        ``keep``: only the parameters whose names it accepts are gathered and copied (a LoRA
        adapter's: the frozen base, most of the model, is never gathered).
        """
        if keep is not None and self.mesh is not None:
            kept: dict[str, Tensor] = {}
            for name, param in self.module.named_parameters():  # the same order on every rank
                if keep(name):
                    full = param.full_tensor() if is_dtensor(param) else param  # type: ignore[attr-defined]
                    kept[name] = full.detach().to("cpu", torch.float32).contiguous()
            return kept if dist.get_rank() == 0 else {}
        if self.mesh is None:
            state = self.module.state_dict()
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(
                self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        out = {name: t.detach().to("cpu", torch.float32).contiguous()
               for name, t in state.items() if keep is None or keep(name)}
        if getattr(getattr(self.module, "config", None), "tie_word_embeddings", False):
            out.pop("lm_head.weight", None)
        return out


def apply_checkpointing(model: nn.Module, every: int) -> int:
    """Activation checkpointing of every ``every``-th decoder layer (1: all; 0: none), with
    torch's composable ``checkpoint`` (non-reentrant, the RNG state kept for dropout); returns
    how many layers it applied to.

    torchtitan wraps each layer in ``checkpoint_wrapper`` instead; that puts
    ``_checkpoint_wrapped_module`` in every module and parameter name below it, which peft
    then cannot match to its own state dict (its adapter comes out empty). The composable
    form hooks the layer in place: module, parameter and state-dict names stay Hugging
    Face's, and FSDP2 composes with it as with the wrapper.
    """
    if every < 1:
        return 0
    from torch.distributed._composable.checkpoint_activation import checkpoint

    layers = [layer for i, layer in enumerate(decoder_layers(model))
              if (i + 1) % every == 0]  # torchtitan's count: layers k, 2k, ... (1-based)
    for layer in layers:
        checkpoint(layer)
    return len(layers)


def _count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def hsdp_mesh(device: torch.device, world: int, shard_group: int | None,
              tp: int = 1) -> DeviceMesh:
    """The mesh of HSDP: ``world // (shard_group * tp)`` replicas, each sharding over
    ``shard_group`` data-parallel ranks; (replicate, shard), or with tensor parallelism
    (replicate, shard, tp), tp innermost: a tensor-parallel group is ``tp`` consecutive
    ranks and a shard group ``shard_group * tp`` consecutive ones (one node, or a group of
    nodes), as torchtitan lays out (dp_replicate, dp_shard, tp)."""
    group = (shard_group or 0) * tp
    if shard_group is None or shard_group < 1 or world % group or world // tp < 2:
        raise InvalidInput(f"training.shard_group {shard_group} times tensor_parallel {tp} "
                           f"must divide the site's {world} ranks (and HSDP needs 2 or more "
                           "data-parallel ranks); choose a divisor.")
    if tp == 1:
        return init_device_mesh(device.type, (world // group, shard_group),
                                mesh_dim_names=HSDP_DIMS)
    return init_device_mesh(device.type, (world // group, shard_group, tp),
                            mesh_dim_names=(*HSDP_DIMS, "tp"))


GROUP_DIMS = ("groups", "dp", "tp")
HSDP_GROUP_DIMS = ("groups", "replicate", "shard")


def group_mesh(device: torch.device, world: int, groups: int, tp: int,
               shard_group: int | None) -> DeviceMesh:
    """The site's mesh with ``groups`` outermost: (groups, dp, tp), or under HSDP
    (``shard_group`` set) (groups, replicate, shard); consecutive ranks form a group."""
    if groups < 2 or world % groups:
        raise InvalidInput(f"training.local_groups.groups {groups} must divide the site's "
                           f"{world} ranks (and be 2 or more); choose a divisor of {world}.")
    per = world // groups
    if shard_group is not None:
        if per % shard_group:
            raise InvalidInput(f"training.shard_group {shard_group} must divide a local "
                               f"group's {per} ranks; choose a divisor of {per}.")
        return init_device_mesh(device.type, (groups, per // shard_group, shard_group),
                                mesh_dim_names=HSDP_GROUP_DIMS)
    if per % tp:
        raise InvalidInput(f"training.tensor_parallel {tp} must divide a local group's {per} "
                           f"ranks; choose a divisor of {per} or fewer groups.")
    return init_device_mesh(device.type, (groups, per // tp, tp), mesh_dim_names=GROUP_DIMS)


def parallelize(model: nn.Module, tp: int, device: torch.device,
                data_parallel: str = "auto", *, precision: str = "auto",
                checkpointing: int = 0, compile: bool = False,
                shard_group: int | None = None, groups: int = 1) -> ParallelModel:
    """Split ``model`` over a (dp, tp) mesh of all ranks and wrap it for data parallelism.

    Every rank must hold the same full weights on entry (they are sliced, not scattered).
    Without a process group the model is returned as it is (with its checkpointing and
    compilation). Tensor parallelism needs a transformers model whose family has a plan;
    FSDP2 shards other models as one unit. ``precision`` (the spec's) gives FSDP2 its bf16
    policy; ``checkpointing``: every k-th decoder layer (:func:`apply_checkpointing`);
    ``compile``: ``torch.compile`` each decoder layer. ``data_parallel`` "hsdp": FSDP2 on
    the 2-D (replicate, shard) mesh of :func:`hsdp_mesh` (torch's HSDP: reduce-scatter
    inside a shard group, all-reduce of the shards across the replicas), ``shard_group``
    data-parallel ranks a group; with tp > 1 that mesh is the (replicate, shard) sub-mesh
    of the 3-D (replicate, shard, tp) one. ``groups`` > 1: the ranks form that many local
    groups, each with this parallelism inside (:func:`group_mesh`;
    HSDP inside groups without tp).
    """
    config = _config_of(model)
    if tp > 1 and config is None:
        raise InvalidInput("tensor_parallel > 1 needs a transformers model; a model.entry_point "
                           "model trains with data parallelism only (tensor_parallel: 1).")
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed and tp != 1:
        raise InvalidInput(f"tensor_parallel {tp} needs {tp} or more ranks; got 1 process.")
    world = dist.get_world_size() if distributed else 1
    if config is not None:
        check_tensor_parallel(config, tp, world)
    mode = data_parallel_mode(data_parallel, tp, _count_params(model), device_memory(device))
    if groups > 1 and distributed:
        mesh: DeviceMesh | None = group_mesh(device, world, groups, tp, shard_group
                                             if data_parallel == "hsdp" else None)
    elif data_parallel == "hsdp" and distributed:
        mesh = hsdp_mesh(device, world, shard_group, tp)
    else:
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=MESH_DIMS) \
            if distributed else None
    if mesh is not None and tp > 1 and config is not None and config.tp_plan is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        plan = config.tp_plan
        for layer in decoder_layers(model):
            parallelize_module(layer, mesh["tp"], layer_plan(plan))
    apply_checkpointing(model, checkpointing)
    if compile:
        for layer in decoder_layers(model):
            layer.compile()  # in place: the module and its parameter names stay
    if mesh is None:
        return ParallelModel(module=model, net=model)
    net: nn.Module
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if uses_bf16(precision, device) else MixedPrecisionPolicy()
        dp_mesh = mesh[HSDP_DIMS] if data_parallel == "hsdp" else mesh["dp"]
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        net = model
        if data_parallel == "hsdp":  # a tp group reads one dp rank's batches (tp innermost)
            return ParallelModel(module=model, net=net, dp_rank=dist.get_rank() // tp,
                                 dp_size=world // tp, tp_size=tp, mesh=mesh, groups=groups)
    else:
        net = DistributedDataParallel(
            model, process_group=mesh.get_group("dp"),
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    first = mesh.get_local_rank("groups") * (world // tp // groups) if groups > 1 else 0
    return ParallelModel(module=model, net=net, dp_rank=first + mesh.get_local_rank("dp"),
                         dp_size=world // tp, tp_size=tp, mesh=mesh, groups=groups)
