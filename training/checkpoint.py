"""Checkpoints at a site and on the coordinator: read one, load its model, write one, and
round 0 (seeded, or from ``model.init``), as torchtitan keeps ``components/checkpoint.py``
apart from the training round. Safetensors only: nothing that crossed a border is unpickled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from xffl.aggregator.exchange import CONFIG_FILE, Manifest, finalize_manifest, staged_dir
from xffl.aggregator.shards import MODEL_FILE, open_model
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.training.config import ModelSpec
from xffl.training.entry import build
from xffl.training.model import (
    ModelConfig,
    build_config,
    export_state_dict,
    load_pretrained,
    load_weights,
    needs_conversion,
)
from xffl.training.seeded import write_seeded
from xffl.training.streamed import (
    Progress,
    copy_init,
    expected_tensors,
    init_tensors,
    model_layout,
)


def read_config(model_dir: Path) -> ModelConfig:
    """The architecture of a checkpoint directory (its config.json)."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise CheckpointError(f"{model_dir}: no {CONFIG_FILE}.") from exc
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}.") from exc


def read_weights(model_dir: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint: model.safetensors or a sharded HF safetensors index."""
    model_dir = Path(model_dir)
    try:
        with open_model(model_dir) as reader:  # checks the index against every shard
            files = reader.files
    except CheckpointError as exc:
        where = "" if exc.message.startswith(str(model_dir)) else f"{model_dir}: "
        raise CheckpointError(f"{where}{exc.message}") from exc
    tensors: dict[str, Tensor] = {}
    for shard in files:
        tensors.update(load_file(model_dir / shard))
    return tensors


def load_model(model_dir: Path, entry_point: str | None = None,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """A CPU model with the weights of a checkpoint directory, in ``dtype`` (fp32 unless a
    frozen LoRA base is kept in bf16).

    transformers' model of the checkpoint's family (``from_pretrained``: built on the meta
    device, loaded tensor by tensor), or the model of ``entry_point`` (package.module:function)
    when given.
    """
    config = read_config(model_dir)
    if entry_point is None:
        with open_model(model_dir):  # the index is checked against every shard first
            pass
        try:
            return load_pretrained(Path(model_dir), dtype)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{model_dir}: {exc}.") from exc
    model = build(config, entry_point)
    try:
        load_weights(model, read_weights(model_dir))
    except ValueError as exc:
        raise CheckpointError(f"{model_dir}: {exc}.") from exc
    return model.to(dtype)


def save_checkpoint(model: nn.Module | dict[str, Tensor], config: ModelConfig, out_dir: Path,
                    manifest: Manifest) -> Manifest:
    """Write model.safetensors, config.json and manifest.json atomically into ``out_dir``.

    ``model`` is a module or an already exported HF-named state dict.
    """
    state = model if isinstance(model, dict) else export_state_dict(model)
    with staged_dir(Path(out_dir)) as tmp:
        save_file(state, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(config.to_json())
        return finalize_manifest(tmp, manifest)


def init_global(run_id: str, model: ModelSpec, seed: int, out_dir: Path,
                max_shard_bytes: int | None = None, *, keep_dtype: bool = False,
                progress: Progress | None = None) -> Manifest:
    """Write the round-0 global checkpoint: a seeded random init, or ``model.init``'s weights.

    Both are streamed (memory: a few MiB, whatever the model), except the seeded init of a
    ``model.entry_point`` model, which its own code builds in memory (the one case that runs
    the user's code here: callers ask the user first, :mod:`xffl.jobs.spec.trust`). A
    ``model.entry_point`` model with ``model.init`` is the init's tensors, not built.
    ``model.init``'s weights are widened to fp32, unless ``keep_dtype`` (a LoRA job's frozen
    base: a bf16 checkpoint stays bf16, byte for byte). ``progress`` follows the streamed
    writes: (elements written, elements in all).
    """
    config = build_config(model)
    # the architecture's origin: the init's config.json, or the preset (never both)
    origin = {"preset": model.preset} if model.init is None else {"init": model.init}
    extra = {**origin, "seed": seed, "entry_point": model.entry_point}
    if model.init is not None:  # copied tensor by tensor: a multi-GB init never sits in RAM
        try:
            if model.entry_point is None:
                shapes = expected_tensors(config, None)
            else:  # the user's model is not built here: the init's own tensors
                with open_model(Path(model.init)) as reader:
                    shapes = init_tensors(reader)
            manifest = Manifest(kind="global", run_id=run_id, round=0, extra={
                **extra, "num_parameters": sum(math.prod(s) for s in shapes.values())})
            if model.entry_point is None and needs_conversion(Path(model.init), config):
                # a checkpoint in a layout transformers converts on load (per-expert MoE
                # weights into fused stacks): transformers loads it whole, xffl writes it
                return save_checkpoint(load_pretrained(Path(model.init)), config,
                                       Path(out_dir), manifest)
            return copy_init(Path(model.init), config, model.entry_point, Path(out_dir),
                             manifest, max_shard_bytes, keep_dtype=keep_dtype,
                             progress=progress)
        except (ValueError, CheckpointError) as exc:
            text = exc.message if isinstance(exc, CheckpointError) else str(exc)
            raise InvalidInput(f"model.init {model.init}: {text.rstrip('.')}.") from exc
    if model.entry_point is not None:  # the user's code decides its own initialisation
        net = build(config, model.entry_point, seed=seed)
        manifest = Manifest(kind="global", run_id=run_id, round=0, extra={
            **extra, "num_parameters": sum(p.numel() for p in net.parameters())})
        return save_checkpoint(net, config, Path(out_dir), manifest)
    # streamed block by block: a 7B model never sits in memory (xffl.training.seeded)
    layout = model_layout(config, None)
    manifest = Manifest(kind="global", run_id=run_id, round=0, extra={
        **extra, "num_parameters": sum(t.numel for t in layout)})
    return write_seeded(layout, seed, Path(out_dir), manifest, config.to_json().encode(),
                        max_shard_bytes, progress=progress)
