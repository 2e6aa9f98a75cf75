"""A site's update written as it is gathered: one tensor at a time, hashed while written.

Every rank walks the model's tensors in name order; a tensor sharded by FSDP2 or tensor
parallelism is made whole by ``full_tensor()`` (a collective every rank takes part in) and
only rank 0 keeps it: it encodes the tensor as the exchange sends it (fp32 weights, a bf16 or
fp16 delta, a quantized delta with error feedback: :mod:`xffl.training.encode`'s rules, piece
by piece) and writes it through :class:`~xffl.aggregator.shard_writer.ShardedWriter`, which
hashes every byte as it writes it, so nothing is read back. Rank 0's extra host memory is the
largest tensor plus a few pieces of :data:`PIECE` elements, where gathering the whole state
dict and handing it to safetensors' ``save_file`` held the model twice.

The output is the exchange format (:mod:`xffl.aggregator.exchange`): the same tensors, the
same tensor index, written atomically. Plain and narrowed exchanges give the very bytes
``save_file`` gives (one dtype: safetensors orders by name); a quantized exchange keeps each
tensor's codes next to its scales (``save_file`` groups the tensors by dtype).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from xffl.aggregator import metrics as metric
from xffl.aggregator.codec import Codec, scale_name
from xffl.aggregator.dtypes import bf16_bits_to_f32, storage_dtype
from xffl.aggregator.exchange import (
    CONFIG_FILE,
    Manifest,
    finalize_manifest,
    fsync_path,
    read_manifest,
    staged_dir,
)
from xffl.aggregator.quantize import dequantize, quantize
from xffl.aggregator.shard_writer import Entries, ShardedWriter
from xffl.aggregator.shards import MODEL_FILE, ModelReader, open_model
from xffl.core.errors import CheckpointError
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.training.feedback import Residuals
from xffl.training.parallelize import ParallelModel, is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

Array = np.ndarray
Shapes = dict[str, tuple[int, ...]]
#: elements encoded at a time (16 MiB of fp32): a multiple of every quantization block size.
PIECE = 1 << 22
_STORED = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
#: bytes after which the writer starts the kernel's writeback (without waiting for it), so
#: that the final fsync, which the other ranks wait for, finds little left to write.
FLUSH_EVERY = 64 << 20


def gather_tensors(pm: ParallelModel) -> tuple[Shapes, Iterator[tuple[str, Tensor | None]]]:
    """The HF names and shapes of the model's checkpoint, and its tensors one at a time.

    The iterator is collective: every rank must run it to the end. Rank 0 gets each tensor
    whole as a float32 CPU tensor (a tied LM head is left out), the others None.
    """
    if pm.mesh is None:
        state = pm.module.state_dict()
    else:  # torch's own names (wrappers' prefixes dropped); the shards, nothing gathered
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(pm.module, options=StateDictOptions())
    if getattr(getattr(pm.module, "config", None), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    names = sorted(state)
    shapes = {n: tuple(int(d) for d in state[n].shape) for n in names}
    main = not dist.is_initialized() or dist.get_rank() == 0

    def tensors() -> Iterator[tuple[str, Tensor | None]]:
        for name in names:
            full: Tensor | None = state[name]
            if is_dtensor(full):
                full = to_rank0(full)  # type: ignore[arg-type]
            out = full.detach().to("cpu", torch.float32).contiguous() \
                if main and full is not None else None
            del full
            yield name, out
            del out  # the caller's tensor is freed before the next one is gathered

    return shapes, tensors()


def _block(shape: tuple[int, ...], placements: Sequence[Placement], sizes: Sequence[int],
           coord: Sequence[int]) -> tuple[list[int], list[int]]:
    """The sizes and offsets of the block a mesh coordinate holds (torch.chunk's split)."""
    from torch.distributed.tensor import Shard

    size, offset = list(shape), [0] * len(shape)
    for placement, n, c in zip(placements, sizes, coord, strict=True):
        if type(placement) is Shard:
            d = placement.dim
            chunk = -(-size[d] // n)
            start = min(c * chunk, size[d])
            offset[d] += start
            size[d] = min(size[d], start + chunk) - start
    return size, offset


def to_rank0(t: DTensor) -> Tensor | None:
    """A DTensor made whole on global rank 0 (None elsewhere); collective over its mesh.

    Sharded (``Shard``) and replicated placements: each block comes to rank 0 once,
    straight into its place in the whole tensor (one replica sends), so rank 0 holds the
    tensor plus at most one block in flight and the other ranks nothing more. Other
    placements (FSDP2's strided shards over tensor-parallel ones): ``full_tensor()``.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, t.placements
    ranks = mesh.mesh.flatten().tolist()
    if 0 not in ranks:  # a submesh without rank 0 (a dp group of another tp rank): idle
        return None
    sizes = tuple(mesh.mesh.shape)
    if (any(type(p) not in (Shard, Replicate) for p in placements)
            or mesh.mesh.reshape(-1)[0].item() != 0):
        full = t.full_tensor()
        return full if dist.get_rank() == 0 else None
    me = dist.get_rank()
    local = t.to_local()
    out = torch.empty(tuple(t.shape), dtype=local.dtype) if me == 0 else None
    for index, rank in enumerate(ranks):
        coord = [int(c) for c in np.unravel_index(index, sizes)]
        if any(type(p) is Replicate and c for p, c in zip(placements, coord, strict=True)):
            continue  # another replica of a block the first one sends
        size, offset = _block(tuple(t.shape), placements, sizes, coord)
        if math.prod(size) == 0 or (rank != me and me != 0):
            continue
        if rank == me and me != 0:
            dist.send(local.contiguous(), dst=0)
            continue
        assert out is not None
        view = out[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))]
        if rank == 0:
            view.copy_(local)
        elif view.is_contiguous() and local.device.type == "cpu":
            dist.recv(view, src=rank)
        else:
            block = torch.empty(size, dtype=local.dtype, device=local.device)
            dist.recv(block, src=rank)
            view.copy_(block)
    return out


def _f32(reader: ModelReader, name: str, start: int, stop: int) -> Array:
    """Flat elements ``[start, stop)`` of a global's tensor as float32 (bf16 widened)."""
    raw = reader.raw(name, start, stop)
    if reader.entry(name).dtype == "BF16":
        return bf16_bits_to_f32(raw)
    return np.asarray(raw, dtype=np.float32)


class UpdateEncoder:
    """One tensor at a time, what :func:`xffl.training.encode.encode_update` makes of it.

    ``shapes``: every tensor of the update (name order). The global ``parent_dir`` is read
    slice by slice for a delta; a quantized exchange with error feedback keeps round
    ``round``'s residual in ``state_dir`` (committed by :meth:`commit`).
    """

    def __init__(self, shapes: Shapes, exchange: ExchangeSpec, parent_dir: Path,
                 state_dir: Path | None = None, round: int = 0, piece: int = PIECE) -> None:
        """Open the parent (for a delta) and the residual (for error feedback); ``piece``:
        elements encoded at a time (a multiple of the quantization block)."""
        if exchange.codec is not None and piece % exchange.codec.block_size:
            raise ValueError(f"piece {piece} is not a multiple of the block size "
                             f"{exchange.codec.block_size}")
        self.piece = piece
        self.shapes = shapes
        self.exchange = exchange
        self.codec: Codec | None = exchange.codec
        delta = self.codec is not None or exchange.update == "delta"
        self._parent = open_model(Path(parent_dir)) if delta else None
        self._residuals: Residuals | None = None
        if self.codec is not None and exchange.feedback and state_dir is not None:
            self._residuals = Residuals(state_dir, round, list(shapes.items()))

    def entries(self) -> Entries:
        """The update file's tensors (name, safetensors dtype, shape), in writing order."""
        return self.layout(self.shapes, self.exchange)

    @staticmethod
    def layout(shapes: Shapes, exchange: ExchangeSpec) -> list[tuple[str, str, tuple[int, ...]]]:
        """The tensors (name, safetensors dtype, shape) an update of ``shapes`` holds."""
        out: list[tuple[str, str, tuple[int, ...]]] = []
        codec = exchange.codec
        for name, shape in shapes.items():
            if codec is None:
                dtype = "F32" if exchange.plain else _STORED[exchange.dtype]
                out.append((name, dtype, shape))
                continue
            numel = math.prod(shape)
            out.append((name, codec.code_dtype, (codec.code_count(numel),)))
            out.append((scale_name(name), "F32", (codec.blocks(numel),)))
        return out

    def _delta(self, name: str, flat: Array, start: int, stop: int) -> Array:
        value = flat[start:stop]
        if self._parent is None:
            return value
        entry = self._parent.entry(name)
        if tuple(entry.shape) != self.shapes[name]:
            raise CheckpointError(f"{name}: shape {list(self.shapes[name])} in the trained "
                                  f"model, {list(entry.shape)} in the global.")
        out: Array = value - _f32(self._parent, name, start, stop)
        return out

    def write(self, writer: ShardedWriter, name: str, tensor: Tensor) -> None:
        """Encode one whole float32 tensor and write it (codes and scales, if quantized)."""
        flat = tensor.detach().reshape(-1).numpy()
        if self.codec is None and self.exchange.plain:
            writer.write_chunk(name, flat)
            return
        if self.codec is None:
            target = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.exchange.dtype)
            for start in range(0, flat.size, self.piece) or [0]:
                value = self._delta(name, flat, start, min(flat.size, start + self.piece))
                if target is not None:  # rounded by torch, as encode_update rounds
                    narrow = torch.from_numpy(np.ascontiguousarray(value)).to(target)
                    value = (narrow.view(torch.int16).numpy().view(np.uint16)
                             if target == torch.bfloat16 else narrow.numpy())
                writer.write_chunk(name, value)
            return
        self._quantized(writer, name, flat, self.codec)

    def _quantized(self, writer: ShardedWriter, name: str, flat: Array, codec: Codec) -> None:
        scales = np.empty(codec.blocks(flat.size), dtype=np.float32)
        for start in range(0, flat.size, self.piece):  # whole blocks: piece % block == 0
            stop = min(flat.size, start + self.piece)
            value = self._delta(name, flat, start, stop)
            carried = None if self._residuals is None else self._residuals.carried(
                name, start, stop)
            if carried is not None:
                value = value + carried
            codes, piece_scales = quantize(codec, value)
            writer.write_chunk(name, codes)
            first = start // codec.block_size
            scales[first:first + piece_scales.size] = piece_scales
            if self._residuals is not None:
                self._residuals.keep(name, value - dequantize(codec, codes, piece_scales,
                                                              value.size))
        if flat.size == 0:
            writer.write_chunk(name, np.empty(0, dtype=np.int8 if codec.bits == 8
                                              else np.uint8))
        writer.write_chunk(scale_name(name), scales)

    def commit(self) -> None:
        """Keep this round's residual (error feedback) and close the parent."""
        if self._residuals is not None:
            self._residuals.commit()
            self._residuals = None
        self.close()

    def close(self) -> None:
        """Drop an unfinished residual and close the parent."""
        if self._residuals is not None:
            self._residuals.abort()
            self._residuals = None
        if self._parent is not None:
            self._parent.close()
            self._parent = None


def save_update(gathered: Iterator[tuple[str, Tensor | None]], shapes: Shapes,
                config_json: str, out_dir: Path, manifest: Manifest, exchange: ExchangeSpec,
                parent_dir: Path, state_dir: Path | None = None,
                max_shard_bytes: int | None = None, piece: int = PIECE, *,
                config_file: str = CONFIG_FILE, tensor_file: str = MODEL_FILE) -> Manifest:
    """Rank 0: write the update from :func:`gather_tensors`' tensors (in ``shapes``' order)
    into ``out_dir``, with ``config_json`` as ``config_file`` (a LoRA adapter's files:
    ``tensor_file`` adapter_model.safetensors, ``config_file`` adapter_config.json).

    The manifest gets the seconds from the first tensor to the last byte on disk (fsync,
    checksums included) as ``save_seconds``. On a failure nothing is left in ``out_dir``
    and the gathering is run to its end first, so the other ranks are not left waiting.
    """
    began = time.perf_counter()
    encoder = UpdateEncoder(shapes, exchange, parent_dir, state_dir, manifest.round, piece)
    try:
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, encoder.entries(), {"format": "pt"},
                               max_shard_bytes=max_shard_bytes, flush_every=FLUSH_EVERY,
                               single_file=tensor_file) as writer:
                for name, tensor in gathered:
                    if tensor is None:
                        raise CheckpointError(f"{name}: rank 0 got no tensor to write.")
                    encoder.write(writer, name, tensor)
                    del tensor
            encoder.commit()
            for file in writer.shard_files:
                fsync_path(tmp / file)
            (tmp / config_file).write_text(config_json)
            seconds = time.perf_counter() - began
            timed = manifest.model_copy(
                update={"metrics": {**manifest.metrics, metric.SAVE_SECONDS: seconds}})
            return finalize_manifest(tmp, timed, checksums=writer.checksums)
    except BaseException:
        encoder.close()
        for _ in gathered:  # the other ranks gather to the end: take part
            pass
        raise


def drain(gathered: Iterator[tuple[str, Tensor | None]]) -> None:
    """Take part in every gather of :func:`gather_tensors` (the ranks that do not write)."""
    for _ in gathered:
        pass


#: ``time_margin: auto``: the seconds kept whatever the model (the update's evaluation is
#: reserved apart), plus :data:`SAVE_SECONDS_PER_GB` for every GB the update writes.
MARGIN_BASE = 120.0
#: 8 s per GB (125 MB/s): gathering, encoding, hashing, writing and fsyncing one stream to a
#: busy parallel file system, conservatively (a local disk here does several times better:
#: bench/save_update); an 8B fp32 update of 32 GB gets 376 s.
SAVE_SECONDS_PER_GB = 8.0


def update_nbytes(shapes: Shapes, exchange: ExchangeSpec) -> int:
    """The bytes of an update of these tensors' in the exchange's encoding (headers aside)."""
    total = 0
    for _, dtype, shape in UpdateEncoder.layout(shapes, exchange):
        total += math.prod(shape) * storage_dtype(dtype).itemsize
    return total


def global_update_nbytes(model_dir: Path, exchange: ExchangeSpec) -> int:
    """The bytes of this round's update: the tensors of the global in ``model_dir`` (its
    manifest's index: an adapter's for LoRA) in the exchange's encoding."""
    tensors = read_manifest(Path(model_dir)).tensors
    return update_nbytes({t.name: tuple(t.shape) for t in tensors}, exchange)


def time_margin(margin: float | str, nbytes: int) -> float:
    """The seconds a round keeps before the SLURM limit: ``margin`` itself, or for ``auto``
    :data:`MARGIN_BASE` plus :data:`SAVE_SECONDS_PER_GB` per GB (1e9 bytes) of ``nbytes``."""
    if margin == "auto":
        return MARGIN_BASE + SAVE_SECONDS_PER_GB * nbytes / 1e9
    return float(margin)
