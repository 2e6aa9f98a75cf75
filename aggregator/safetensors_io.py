"""Tensor-at-a-time safetensors I/O: memmap reads of one tensor or slice, a header-first writer.

Reading never loads a whole file: :class:`SafetensorsReader` parses and validates the header
(truncation, holes, sizes), then maps only the byte range of the tensor or slice asked for,
released as soon as the caller drops the array, or copies it into a caller's reused buffer.
:class:`SafetensorsWriter` writes the header first (its size follows from the declared
entries), then takes the tensors in header order, possibly in several consecutive flat
pieces, converting each to the declared dtype on the way (fp32 -> bf16 rounds to nearest
even, bit for bit as torch's CPU kernel).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from xffl.aggregator.dtypes import (
    FLOAT_DTYPES,
    STORAGE_DTYPES,
    Array,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    storage_dtype,
    to_storage,
)
from xffl.aggregator.st_header import (
    MAX_HEADER,
    TensorEntry,
    header_cap,
    no_duplicate_keys,
    parse_header,
)
from xffl.core.errors import CheckpointError

__all__ = [
    "FLOAT_DTYPES",
    "MAX_HEADER",
    "STORAGE_DTYPES",
    "Array",
    "SafetensorsReader",
    "SafetensorsWriter",
    "TensorEntry",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "header_bytes",
    "header_cap",
    "no_duplicate_keys",
    "storage_dtype",
    "to_storage",
]

class SafetensorsReader:
    """A validated view of a safetensors file that maps one tensor, or one slice, at a time.

    The header is held to the rules of the safetensors crate (what transformers and peft
    load with), so that nothing xffl admits is refused by them: at most ``max_header``
    bytes (never more than the crate's 100 MB), UTF-8 JSON whose top level is an object,
    no key given twice, ``__metadata__`` null or strings to strings, every tensor's dtype a
    known name, shape and data_offsets lists of non-negative integers below 2**64, the
    offsets contiguous from 0 and covering the data section exactly.
    """

    def __init__(self, path: Path, max_header: int = MAX_HEADER) -> None:
        """Open ``path`` and validate its header against the file size (truncation, holes);
        ``max_header``: refuse a longer header before reading it."""
        self.path = Path(path)
        self._max_header = min(max_header, MAX_HEADER)
        self._fh = self.path.open("rb")
        try:
            self._parse()
        except BaseException:
            self._fh.close()
            raise

    def _fail(self, reason: str) -> CheckpointError:
        return CheckpointError(f"{self.path.name}: {reason}.")

    def _parse(self) -> None:
        size = os.fstat(self._fh.fileno()).st_size
        raw = self._fh.read(8)
        if len(raw) != 8:
            raise self._fail("not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > self._max_header:
            raise self._fail(f"header of {hlen} bytes, more than the {self._max_header} "
                             "allowed")
        if 8 + hlen > size:
            raise self._fail(f"header length {hlen} does not fit in a {size}-byte file")
        try:
            self.metadata, entries = parse_header(self._fh.read(hlen), 8 + hlen)
        except ValueError as exc:
            raise self._fail(str(exc)) from exc
        self.data_start = 8 + hlen
        entries.sort(key=lambda e: (e.start, e.end))
        cursor = self.data_start
        for entry in entries:
            if entry.start != cursor:
                raise self._fail(f"tensor {entry.name!r} overlaps or leaves a hole in the data")
            cursor = entry.end
        if size < cursor:
            raise self._fail(f"truncated: {size} bytes, the header describes {cursor}")
        if size > cursor:
            raise self._fail(f"{size - cursor} unexpected bytes after the last tensor")
        self.size = size
        self.entries: dict[str, TensorEntry] = {e.name: e for e in entries}

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self.entries)

    def entry(self, name: str) -> TensorEntry:
        """The header entry of one tensor."""
        try:
            return self.entries[name]
        except KeyError:
            raise self._fail(f"no tensor named {name!r}") from None

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> Array:
        """Flat storage elements ``[start, stop)`` of a tensor as a read-only memmap."""
        e = self.entry(name)
        stop = e.numel if stop is None else stop
        if not 0 <= start <= stop <= e.numel:
            raise self._fail(f"slice [{start}, {stop}) out of range for {name!r}")
        dtype = storage_dtype(e.dtype)
        if stop == start:
            return np.empty(0, dtype=dtype)
        return np.memmap(
            self._fh,
            dtype=dtype,
            mode="r",
            offset=e.start + start * dtype.itemsize,
            shape=(stop - start,),
        )

    def read_into(self, name: str, start: int, out: Array) -> Array:
        """Copy flat storage elements ``[start, start + out.size)`` of a tensor into ``out``.

        A positional read into a reused buffer: on small VMs it costs less CPU than faulting
        in memmapped pages, and it is safe to call from several threads.
        """
        e = self.entry(name)
        dtype = storage_dtype(e.dtype)
        if out.dtype != dtype or not out.flags.c_contiguous:
            raise self._fail(f"read_into {name!r}: need a contiguous {dtype} buffer")
        if not 0 <= start <= start + out.size <= e.numel:
            raise self._fail(f"slice [{start}, {start + out.size}) out of range for {name!r}")
        view = out.data.cast("B")
        offset = e.start + start * dtype.itemsize
        done = 0
        while done < len(view):
            n = os.preadv(self._fh.fileno(), [view[done:]], offset + done)
            if n == 0:
                raise self._fail(f"unexpected end of file while reading {name!r}")
            done += n
        return out

    def read(self, name: str) -> Array:
        """One whole tensor, decoded (bf16 -> float32) and copied into memory, in its shape."""
        e = self.entry(name)
        raw = self.raw(name)
        out = bf16_bits_to_f32(raw) if e.dtype == "BF16" else np.array(raw)
        return out.reshape(e.shape)

    def chunks(self, name: str, max_elements: int) -> Iterator[Array]:
        """Yield a tensor's flat storage elements in memmapped pieces of at most max_elements."""
        numel = self.entry(name).numel
        for start in range(0, numel, max_elements):
            stop = min(start + max_elements, numel)
            self.prefetch(name, stop, min(stop + max_elements, numel))
            yield self.raw(name, start, stop)

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Ask the kernel to start reading elements ``[start, stop)`` of a tensor ahead of use."""
        e = self.entry(name)
        if stop > start and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(
                self._fh.fileno(),
                e.start + start * e.itemsize,
                (stop - start) * e.itemsize,
                os.POSIX_FADV_WILLNEED,
            )

    def close(self) -> None:
        """Close the file (arrays already handed out keep their own mapping)."""
        self._fh.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def header_bytes(
    entries: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """The 8-byte length + space-padded JSON header for these entries, and their layout."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    layout: list[tuple[str, str, tuple[int, ...], int, int]] = []
    for name, dtype, shape in entries:
        if name in header or name == "__metadata__":
            raise CheckpointError(f"duplicate tensor name {name!r}.")
        dims = tuple(int(d) for d in shape)
        nbytes = math.prod(dims) * storage_dtype(dtype).itemsize
        header[name] = {
            "dtype": dtype,
            "shape": list(dims),
            "data_offsets": [offset, offset + nbytes],
        }
        layout.append((name, dtype, dims, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [
        TensorEntry(n, d, s, start + b, start + e) for n, d, s, b, e in layout
    ]


W = TypeVar("W", bound="AbortingWriter")


class AbortingWriter:
    """A writer used as a context manager: closed when the block ends normally, aborted
    (what it wrote removed) when it raises."""

    _closed: bool

    def close(self) -> None:
        """Finish the output."""
        raise NotImplementedError

    def abort(self) -> None:
        """Remove what was written."""
        raise NotImplementedError

    def __enter__(self: W) -> W:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if typ is None:
            self.close()
        elif not self._closed:
            self.abort()


class SafetensorsWriter(AbortingWriter):
    """Write a safetensors file header first, then its tensors in header order, piece by piece."""

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        *,
        flush_every: int = 0,
    ) -> None:
        """Create ``path`` and write the header; flush_every > 0 starts writeback every N bytes."""
        self.path = Path(path)
        head, self._layout = header_bytes(entries, metadata)
        self._hash = hashlib.sha256(head)
        self._flush_every = flush_every
        self._flushed = 0
        self._index = 0
        self._done = 0  # elements of the current tensor already written
        self._closed = False
        self._digest: str | None = None
        self._fh = self.path.open("wb", buffering=1 << 20)
        self._fh.write(head)
        self._pos = len(head)

    def write(self, name: str, array: Array) -> None:
        """Write one whole tensor; its shape must be the declared one."""
        entry = self._current(name)
        if self._done or tuple(np.shape(array)) != entry.shape:
            raise CheckpointError(
                f"{self.path.name}: tensor {name!r} has shape {list(np.shape(array))}, "
                f"declared {list(entry.shape)}."
            )
        self.write_chunk(name, array)

    def write_chunk(self, name: str, array: Array) -> None:
        """Append the next flat piece of tensor ``name`` (converted to its declared dtype)."""
        entry = self._current(name)
        data = to_storage(array, entry.dtype).reshape(-1)
        if self._done + data.size > entry.numel:
            raise CheckpointError(
                f"{self.path.name}: too many elements for {name!r} "
                f"({self._done + data.size} > {entry.numel})."
            )
        view = data.data.cast("B")
        self._hash.update(view)
        self._fh.write(view)
        self._pos += len(view)
        self._done += data.size
        if self._done == entry.numel:
            self._index += 1
            self._done = 0
        if self._flush_every and self._pos - self._flushed >= self._flush_every:
            self._start_writeback()

    def _start_writeback(self) -> None:
        # POSIX_FADV_DONTNEED makes Linux start writing dirty pages back without waiting
        # for them, so the final fsync finds little left to do.
        self._fh.flush()
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(
                self._fh.fileno(), self._flushed, self._pos - self._flushed, os.POSIX_FADV_DONTNEED
            )
        self._flushed = self._pos

    def _current(self, name: str) -> TensorEntry:
        if self._closed:
            raise CheckpointError(f"{self.path.name}: the writer is closed.")
        if self._index >= len(self._layout):
            raise CheckpointError(f"{self.path.name}: tensor {name!r} is past the header's end.")
        entry = self._layout[self._index]
        if entry.name != name:
            raise CheckpointError(
                f"{self.path.name}: expected tensor {entry.name!r} next (header order), "
                f"got {name!r}."
            )
        return entry

    @property
    def sha256(self) -> str:
        """The sha256 of the complete file (available after close)."""
        if self._digest is None:
            raise CheckpointError(f"{self.path.name}: sha256 is known only after close().")
        return self._digest

    def close(self) -> None:
        """Check that every declared tensor was written in full, then flush and close."""
        if self._closed:
            return
        if self._index < len(self._layout):
            missing = self._layout[self._index].name
            self.abort()
            raise CheckpointError(f"{self.path.name}: tensor {missing!r} was not written.")
        self._fh.close()
        self._closed = True
        self._digest = self._hash.hexdigest()

    def abort(self) -> None:
        """Close and delete the partial file."""
        self._closed = True
        self._fh.close()
        self.path.unlink(missing_ok=True)
