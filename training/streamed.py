"""Checkpoints written tensor by tensor, so that a multi-GB model never sits whole in memory.

Round 0 from ``model.init``: the coordinator checks the given checkpoint's names, shapes and
dtypes against the model built on the meta device (a ``model.entry_point`` model is not
built: its code does not run on the coordinator, and the sites check names and shapes when
they load it), then copies it to fp32 in pieces of a fixed size (fp32 tensors byte for
byte, bf16/fp16 widened exactly), reading the next piece while writing this one: memory is
two pieces, not a tensor. (A seeded round 0 is written by :mod:`xffl.training.seeded`.) And
``training.update_fn``, a site's local update computed per tensor instead of by SGD (NVIDIA
FLARE's large-model tests add a delta the same way), whose memory is the largest tensor.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xffl.aggregator.dtypes import FLOAT_DTYPES, bf16_bits_to_f32, storage_dtype
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
from xffl.training.arch import ModelConfig
from xffl.training.config import TrainJob, check_entry_point
from xffl.training.entry import build
from xffl.training.model import meta_model
from xffl.training.model import model_layout as family_layout
from xffl.training.seeded import TensorInit

Array = np.ndarray
#: a long write's progress: (elements written, elements in all)
Progress = Callable[[int, int], None]
#: elements a checkpoint is copied by (16 MiB in fp32): large reads and writes, small memory.
COPY_PIECE = 1 << 22


def expected_tensors(config: ModelConfig, entry_point: str | None) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of the model's checkpoint, from a build on the meta device."""
    if entry_point is None:
        model: torch.nn.Module = meta_model(config)
    else:
        with torch.device("meta"):
            model = build(config, entry_point)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def model_layout(config: ModelConfig, entry_point: str | None) -> list[TensorInit]:
    """Every tensor of the model's checkpoint with its seeded rule, in checkpoint order.

    A transformers model: its family's rules (:func:`xffl.training.model.model_layout`). An
    entry point's model, from its meta-device build: names ending in ``norm.weight`` 1,
    ``bias`` 0, the rest N(0, initializer_range).
    """
    if entry_point is None:
        return family_layout(config)
    std = config.initializer_range
    out = []
    for name, shape in sorted(expected_tensors(config, entry_point).items()):
        if name.endswith("norm.weight"):
            out.append(TensorInit(name, shape, "constant", 1.0))
        elif name.endswith("bias"):
            out.append(TensorInit(name, shape, "constant", 0.0))
        else:
            out.append(TensorInit(name, shape, "normal", std))
    return out


def init_tensors(reader: ModelReader) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a checkpoint's tensors, as round 0 of a ``model.entry_point``
    model takes them (nothing is built: the user's code never runs on the coordinator);
    ValueError naming a tensor that is not of a floating-point type."""
    shapes = {}
    for name in reader.names():
        if name.endswith("rotary_emb.inv_freq"):  # recomputed by the model, as check_init
            continue
        entry = reader.entry(name)
        if entry.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{reader.shard_of(name).path.name}: tensor {name} is "
                             f"{entry.dtype}, not a floating-point type")
        shapes[name] = tuple(entry.shape)
    return shapes


def _as_f32(reader: ModelReader, name: str) -> Array:
    """One tensor of ``reader`` as a float32 array of its own (bf16 decoded)."""
    dtype = reader.entry(name).dtype
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {name} is {dtype}, not a floating-point type")
    return reader.read(name).astype(np.float32, copy=False)


def check_init(reader: ModelReader, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError unless the checkpoint holds exactly the model's tensors, in float types and
    the model's shapes (the message names the file and the tensor)."""
    given = {n for n in reader.names() if not n.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(set(shapes) - given), sorted(given - set(shapes))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, shape in shapes.items():
        entry, file = reader.entry(name), reader.shard_of(name).path.name
        if entry.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{file}: tensor {name} is {entry.dtype}, not a floating-point "
                             "type")
        if tuple(entry.shape) != shape:
            raise ValueError(f"{file}: tensor {name} has shape {tuple(entry.shape)}, the "
                             f"model expects {shape}")


def _raw_pieces(reader: ModelReader, names: list[str],
                piece: int) -> Iterator[tuple[str, Array]]:
    """(name, piece of its storage elements, as stored: bf16 as its bits) of every tensor in
    order, at most ``piece`` elements each, read through memory maps."""
    for name in names:
        if reader.entry(name).numel == 0:  # the writer still wants the (empty) tensor
            yield name, np.empty(0, storage_dtype(reader.entry(name).dtype))
        yield from ((name, chunk) for chunk in reader.chunks(name, piece))


def _f32_pieces(reader: ModelReader, names: list[str],
                piece: int) -> Iterator[tuple[str, Array]]:
    """(name, float32 piece) of every tensor in order, at most ``piece`` elements each.

    Two reused buffer pairs: a thread reads (and widens) the next piece with positional reads
    while the caller hashes and writes this one, so reading costs no time of its own.
    """
    tasks = [(n, start) for n in names
             for start in range(0, max(reader.entry(n).numel, 1), piece)]
    f32 = [np.empty(piece, np.float32) for _ in range(2)]
    widest = max((reader.entry(n).itemsize for n in names if reader.entry(n).dtype != "F32"),
                 default=0)  # fp32 is read straight into ``f32``
    raw = [np.empty(piece * widest, np.uint8) for _ in range(2)]

    def load(task: int) -> Array:
        name, start = tasks[task]
        entry = reader.entry(name)
        n = min(piece, entry.numel - start)
        out = f32[task % 2][:n]
        if entry.dtype == "F32":
            return reader.read_into(name, start, out)
        dtype = storage_dtype(entry.dtype)
        src = reader.read_into(name, start, raw[task % 2][:n * dtype.itemsize].view(dtype))
        if entry.dtype == "BF16":
            return bf16_bits_to_f32(src, out=out)
        np.copyto(out, src, casting="same_kind")
        return out

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xffl-copy") as pool:
        ahead: Future[Array] | None = pool.submit(load, 0) if tasks else None
        for task in range(len(tasks)):
            assert ahead is not None
            current = ahead.result()
            ahead = pool.submit(load, task + 1) if task + 1 < len(tasks) else None
            yield tasks[task][0], current
            # the caller is done with ``current``; its buffers are reused two tasks on


def copy_init(init: Path, config: ModelConfig, entry_point: str | None, out_dir: Path,
              manifest: Manifest, max_shard_bytes: int | None,
              piece: int = COPY_PIECE, *, keep_dtype: bool = False,
              progress: Progress | None = None) -> Manifest:
    """Write ``init``'s weights as fp32 into ``out_dir`` (a global checkpoint), streamed.

    Memory: two pieces of ``piece`` elements (16 MiB in fp32 by default) and their raw
    bytes, whatever the model; fp32 tensors are copied as they are, other float types
    widened (bf16 and fp16 exactly). ``keep_dtype`` (a LoRA job's frozen base, never
    trained): every tensor keeps its checkpoint's dtype, byte for byte. With
    ``entry_point`` the tensors are ``init``'s own (:func:`init_tensors`): the entry point
    is not imported. ``progress`` gets (elements written, elements in all) after each piece.
    """
    with open_model(init) as reader:
        if entry_point is None:
            shapes = expected_tensors(config, None)
            check_init(reader, shapes)
        else:
            shapes = init_tensors(reader)
        names = sorted(shapes)  # as safetensors orders them
        entries = [(n, reader.entry(n).dtype if keep_dtype else "F32", shapes[n])
                   for n in names]
        total, done = sum(reader.entry(n).numel for n in names), 0
        pieces = (_raw_pieces(reader, names, piece) if keep_dtype
                  else _f32_pieces(reader, names, piece))
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, entries, {"format": "pt"},
                               max_shard_bytes=max_shard_bytes) as writer:
                for name, values in pieces:
                    writer.write_chunk(name, values)
                    done += values.size
                    if progress is not None:
                        progress(done, total)
            (tmp / CONFIG_FILE).write_text(config.to_json())
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
