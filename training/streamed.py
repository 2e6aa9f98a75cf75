"""Checkpoints written tensor by tensor, so that a multi-GB model never sits whole in memory.

Two users: round 0 from ``model.init`` (the coordinator copies and converts the given
checkpoint to fp32 one tensor at a time, after checking its names and shapes against the
model built on the meta device), and ``training.update_fn``, a site's local update computed
per tensor instead of by SGD (NVIDIA FLARE's large-model tests add a delta the same way).
The largest tensor, not the model, bounds the memory of both.
"""

from __future__ import annotations

import importlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xffl.aggregator.dtypes import FLOAT_DTYPES
from xffl.aggregator.exchange import (
    CONFIG_FILE,
    Manifest,
    finalize_manifest,
    staged_dir,
    verify_checkpoint,
)
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import ModelReader, open_model
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.training.arch import LlamaConfig
from xffl.training.config import TrainJob, check_entry_point
from xffl.training.entry import build

Array = np.ndarray


def expected_tensors(config: LlamaConfig, entry_point: str | None) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the model's checkpoint, from a build on the meta device."""
    with torch.device("meta"):
        model = build(config, entry_point)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _as_f32(reader: ModelReader, name: str) -> Array:
    """One tensor of ``reader`` as a float32 array of its own (bf16 decoded)."""
    dtype = reader.entry(name).dtype
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name} is {dtype}, not a floating-point type")
    return reader.read(name).astype(np.float32, copy=False)


def copy_init(init: Path, config: LlamaConfig, entry_point: str | None, out_dir: Path,
              manifest: Manifest, max_shard_bytes: int | None) -> Manifest:
    """Write ``init``'s weights as fp32 into ``out_dir`` (a global checkpoint), one at a time."""
    shapes = expected_tensors(config, entry_point)
    with open_model(init) as reader:
        given = {n for n in reader.names() if not n.endswith("rotary_emb.inv_freq")}
        missing, unexpected = sorted(set(shapes) - given), sorted(given - set(shapes))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, shape in shapes.items():
            if tuple(reader.entry(name).shape) != shape:
                raise ValueError(f"checkpoint tensor {name} has shape "
                                 f"{tuple(reader.entry(name).shape)}, the model expects {shape}")
        entries = [(n, "F32", shapes[n]) for n in sorted(shapes)]  # as safetensors orders them
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, entries, {"format": "pt"},
                               max_shard_bytes=max_shard_bytes) as writer:
                for name, _, _ in entries:
                    writer.write_chunk(name, _as_f32(reader, name))
            (tmp / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
            return finalize_manifest(tmp, manifest, checksums=writer.checksums)


@dataclass(frozen=True)
class UpdateContext:
    """What a per-tensor update function knows besides the tensor."""

    site: str
    round: int
    seed: int


UpdateFn = Callable[[str, Array, UpdateContext], Array]


def load_update_fn(entry_point: str) -> UpdateFn:
    """Import ``training.update_fn`` (package.module:function); InvalidInput if it cannot."""
    module_name, _, attr = check_entry_point(entry_point).partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as exc:
        raise InvalidInput(f"training.update_fn {entry_point}: cannot import {module_name} "
                           f"({exc}); install it at every site or add its folder to "
                           "PYTHONPATH in the site profile's env.") from exc
    if not callable(fn):
        raise InvalidInput(f"training.update_fn {entry_point}: {module_name} has no function "
                           f"{attr}; name a function (name, array, context) -> array.")
    return fn  # type: ignore[no-any-return]


def tensor_update_round(job: TrainJob, round: int, model_dir: Path, out_dir: Path) -> Manifest:
    """A site's update made by ``job.training.update_fn``, applied tensor by tensor.

    The function gets each tensor as float32 and returns the updated one (same shape); the
    update keeps the global's dtypes. Its sample count is what SGD would have seen
    (steps x batch_size), so FedAvg weighs such sites as it would weigh trained ones.
    """
    assert job.training.update_fn is not None
    fn = load_update_fn(job.training.update_fn)
    parent = verify_checkpoint(Path(model_dir))
    context = UpdateContext(job.site, round, job.training.seed)
    manifest = Manifest(kind="update", run_id=parent.run_id, round=round, site=job.site,
                        parent=parent.digest(),
                        num_samples=job.training.steps * job.training.batch_size,
                        extra={"update_fn": job.training.update_fn})
    with open_model(Path(model_dir)) as reader:
        entries = [(n, reader.entry(n).dtype, tuple(reader.entry(n).shape))
                   for n in reader.names()]
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, entries, {"format": "pt"},
                               max_shard_bytes=None) as writer:
                for name, _, shape in entries:
                    new = np.asarray(fn(name, _as_f32(reader, name), context))
                    if new.shape != shape:
                        raise InvalidInput(
                            f"training.update_fn {job.training.update_fn} returned shape "
                            f"{new.shape} for {name}, which has shape {shape}.")
                    writer.write_chunk(name, new)
            (tmp / CONFIG_FILE).write_bytes((Path(model_dir) / CONFIG_FILE).read_bytes())
            return finalize_manifest(tmp, manifest, checksums=writer.checksums)


def delta_value(site: str, round: int, name: str) -> float:
    """The constant :func:`add_delta` adds to tensor ``name`` at ``site`` in ``round``."""
    key = zlib.crc32(f"{site}/{name}".encode())
    return ((key % 1000) + 1) * 1e-6 * round


def add_delta(name: str, value: Array, context: UpdateContext) -> Array:
    """A deterministic stand-in for training: add :func:`delta_value` to every element.

    ``training.update_fn: xffl.training.streamed:add_delta`` moves a model of any size
    through every round without computing gradients (bench/large_model uses it): the global
    after R rounds of FedAvg with equal weights is w0 + sum over rounds of the sites' mean
    delta, which a test can check exactly.
    """
    value += np.float32(delta_value(context.site, context.round, name))
    return value
