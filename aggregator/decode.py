"""An update as the weights it stands for, whatever the exchange encoded.

A site may send its weights in a narrower dtype (``exchange.dtype: bf16 | fp16``) or only
their change from the round's global model (``exchange.update: delta``). Every strategy reads
updates through a reader; :class:`DecodedReader` is one that gives, for each tensor, the
weights in the global model's dtype: ``global + delta`` (computed in float64, rounded once
to the global's dtype) or the widened weights. Strategies, clipping and the running FedAvg
then work unchanged on any exchange.

Which encoding an update is in is the coordinator's own knowledge (the job spec), never the
update's word; admission has already checked that the update's tensors have the encoding's
dtype and the global's names and shapes. A quantized delta (``exchange.dtype: int8 | nf4 |
fp4``) is dequantized here slice by slice (:mod:`xffl.aggregator.quantize`): a read of
elements ``[lo, hi)`` reads the codes and scales of the blocks that cover them, nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xffl.aggregator.codec import Codec, scale_name
from xffl.aggregator.dtypes import decode, encode, storage_dtype
from xffl.aggregator.exchange import TensorInfo
from xffl.aggregator.safetensors_io import Array, TensorEntry
from xffl.aggregator.shards import ModelReader, open_model

FLOATS = frozenset({"F32", "F16", "BF16", "F64"})
_SCAN = 1 << 20  # elements per slice of the overflow scan


@dataclass(frozen=True)
class Decoding:
    """How the coordinator reads a round's updates: against ``reference`` (the global the
    round started from), which is added back when the updates are deltas."""

    reference: Path
    delta: bool = False
    codec: Codec | None = None  # a quantized delta's


def encoded_index(reference: Sequence[TensorInfo], dtype: str,
                  codec: Codec | None = None) -> list[TensorInfo]:
    """The tensor index an encoded update must have: the global's names and shapes, every
    floating-point tensor in ``dtype`` (a safetensors dtype string); with ``codec``, every
    floating-point tensor as its flat codes and its scales (``name.absmax``, F32)."""
    if codec is None:
        return [t.model_copy(update={"dtype": dtype}) if t.dtype in FLOATS else t
                for t in reference]
    out: list[TensorInfo] = []
    names = {t.name for t in reference}
    for t in reference:
        if t.dtype not in FLOATS:
            out.append(t)
            continue
        if scale_name(t.name) in names:
            raise ValueError(f"tensor {t.name!r} of the global model is named like the "
                             "scales of another; this model cannot be exchanged quantized")
        numel = math.prod(t.shape)
        out.append(TensorInfo(name=t.name, dtype=codec.code_dtype,
                              shape=[codec.code_count(numel)]))
        out.append(TensorInfo(name=scale_name(t.name), dtype="F32",
                              shape=[codec.blocks(numel)]))
    return sorted(out, key=lambda t: t.name)


class DecodedReader:
    """The reader interface strategies use, over an encoded update and the round's global.

    ``delta``: the update holds ``w - global`` (added back here); otherwise it holds the
    weights, maybe in a narrower dtype. Tensors that are not floating point (none in xffl's
    models) are read as they are.
    """

    def __init__(self, update: ModelReader, reference: ModelReader, *, delta: bool,
                 codec: Codec | None = None) -> None:
        """Wrap two open readers; :meth:`close` closes both. ``codec``: the update holds a
        quantized delta."""
        self.update = update
        self.reference = reference
        self.delta = delta or codec is not None
        self.codec = codec
        self.path = update.path
        self.index_file = update.index_file
        self.metadata = update.metadata
        #: the global's entries: its dtype is what every read returns
        self.entries: dict[str, TensorEntry] = dict(reference.entries)

    @property
    def files(self) -> list[str]:
        """The update's files holding tensors."""
        return self.update.files

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self.entries)

    def entry(self, name: str) -> TensorEntry:
        """The global's entry of ``name`` (dtype and shape of what reads return)."""
        return self.reference.entry(name)

    def read_into(self, name: str, start: int, out: Array) -> Array:
        """Decoded elements ``[start, start + out.size)`` of ``name`` in the global's dtype."""
        target = self.reference.entry(name).dtype
        stored = self.update.entry(name).dtype
        n = out.shape[0]
        if target not in FLOATS or (stored == target and not self.delta):
            return self.update.read_into(name, start, out)
        if self.codec is not None:
            acc = self.dequantized(name, start, n)
        else:
            raw = self.update.read_into(name, start, np.empty(n, dtype=storage_dtype(stored)))
            acc = decode(raw, stored)  # float64: exact for every stored float
        if self.delta:
            base = self.reference.read_into(name, start, np.empty(n, dtype=storage_dtype(target)))
            np.add(acc, decode(base, target), out=acc)
        with np.errstate(over="ignore"):  # an overflow is inf, which admission looks for
            encode(acc, target, out, np.empty(n, dtype=np.float32))
        return out

    def dequantized(self, name: str, start: int, n: int) -> Array:
        """Elements ``[start, start + n)`` of a quantized delta as the coordinator decodes
        them (float64, before they are added to the global)."""
        from xffl.aggregator.quantize import dequantize

        codec = self.codec
        assert codec is not None
        numel = self.reference.entry(name).numel
        b0, b1, e0, e1 = codec.span(numel, start, start + n)
        scales = self.update.read_into(scale_name(name), b0, np.empty(b1 - b0, np.float32))
        c0, c1 = (e0, e1) if codec.bits == 8 else (e0 // 2, (e1 + 1) // 2)
        codes = self.update.read_into(name, c0, np.empty(
            c1 - c0, dtype=storage_dtype(codec.code_dtype)))
        values = dequantize(codec, codes, scales, e1 - e0)
        return values[start - e0: start - e0 + n]

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> Array:
        """Decoded elements ``[start, stop)`` in the global's storage dtype (a new array)."""
        entry = self.reference.entry(name)
        end = entry.numel if stop is None else stop
        return self.read_into(name, start, np.empty(end - start, dtype=storage_dtype(entry.dtype)))

    def read(self, name: str) -> Array:
        """One whole tensor, decoded and in its shape (bf16 as float32, as ModelReader.read)."""
        entry = self.reference.entry(name)
        flat = self.raw(name)
        if entry.dtype == "BF16":
            return decode(flat, "BF16").astype(np.float32).reshape(entry.shape)
        return flat.reshape(entry.shape)

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Start reading ahead in the update and, for a delta, in the global."""
        if self.codec is None:
            self.update.prefetch(name, start, stop)
        if self.delta:
            self.reference.prefetch(name, start, stop)

    def close(self) -> None:
        """Close both readers."""
        self.update.close()
        self.reference.close()

    def __enter__(self) -> DecodedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def first_overflow(update: Path, reference: Path, codec: Codec | None = None) -> str | None:
    """The first tensor whose delta, added to ``reference``, leaves the global's dtype's
    range (finite values that sum to inf); None when every sum is finite.

    Admission checks the stored values are finite; a hostile site could still send a finite
    delta that overflows once added to the global, and poison a mean with inf.
    """
    with DecodedReader(open_model(update), open_model(reference), delta=True,
                       codec=codec) as reader:
        for name in reader.names():
            entry = reader.entry(name)
            if entry.dtype not in FLOATS:
                continue
            for lo in range(0, entry.numel, _SCAN):
                raw = reader.raw(name, lo, min(entry.numel, lo + _SCAN))
                if not np.isfinite(decode(raw, entry.dtype)).all():
                    return name
    return None


def bad_scales(update: Path, reference: Path, codec: Codec) -> str | None:
    """Why a quantized delta's block scales do not fit (None when they do): a scale that is
    negative (an absmax never is), or larger than the global's dtype can hold (the block's
    decoded values would overflow it). Non-finite scales are admission's finite check's.
    """
    with open_model(update) as upd, open_model(reference) as ref:
        for name in sorted(ref.entries):
            dtype = ref.entries[name].dtype
            if dtype not in FLOATS:
                continue
            limit = float(np.finfo(np.float16).max) if dtype == "F16" else float(
                np.finfo(np.float32).max)
            scales = upd.raw(scale_name(name)).astype(np.float64)
            if scales.size and scales.min() < 0:
                return (f"tensor {name!r} has a negative block scale ({scales.min():g} in "
                        f"{scale_name(name)}); a block's absmax never is")
            if scales.size and scales.max() > limit:
                return (f"a block scale of tensor {name!r} ({scales.max():g}) overflows the "
                        f"global's {dtype}")
    return None
