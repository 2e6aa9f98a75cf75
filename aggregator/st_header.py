"""The header of a safetensors file, read as the safetensors crate reads it.

transformers and peft load checkpoints with the crate, so a header xffl accepts must be one
the crate accepts too (else a global xffl admitted could not be loaded): at most 100 MB
(and, for an update, what its tensors need: :func:`header_cap`, checked before reading),
UTF-8 JSON whose top level is an object, no key given twice, ``__metadata__`` null or
strings to strings, each tensor exactly ``dtype`` (a known name), ``shape`` and
``data_offsets`` (two), all non-negative integers below 2**64 (no floats, booleans or
strings), with ``nelements x dtype size`` not overflowing and equal to ``end - begin``.
The reader then checks the offsets are contiguous from 0 and cover the data section.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from xffl.aggregator.dtypes import STORAGE_DTYPES, storage_dtype

MAX_HEADER = 100_000_000  # the safetensors crate's own limit (HeaderTooLarge above it)
_U64 = 1 << 64  # shapes and offsets are usize in the crate: larger ones overflow there


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (absolute byte offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return storage_dtype(self.dtype).itemsize


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook that refuses a key given twice (two parsers could each keep a
    different one of them: a hostile header says one thing to a checker, another to a
    loader)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def header_cap(tensors: Iterable[tuple[str, Sequence[int]]]) -> int:
    """The most header bytes a safetensors file of these tensors (name, shape) needs.

    Each entry, written compactly, is its JSON-escaped name and at most 91 bytes of dtype,
    offsets and punctuation plus 21 per dimension (a 20-digit integer and a comma); twice
    that, for whitespace, and 64 KiB for ``__metadata__``. An update's header is refused
    above it before any of it is read or parsed.
    """
    compact = sum(len(json.dumps(name)) + 91 + 21 * len(shape) for name, shape in tensors)
    return min(MAX_HEADER, 2 * compact + (64 << 10))


def _integer(value: Any) -> bool:
    """A JSON integer the crate reads as usize (not a bool, a float or a string)."""
    return type(value) is int and 0 <= value < _U64


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _entry(name: str, info: Any, data_start: int) -> TensorEntry:
    """One header entry, checked as the crate reads it (types, sizes, no overflow)."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"malformed header entry for {name[:100]!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(_integer(d) for d in shape) or \
            not isinstance(offsets, list) or len(offsets) != 2 or \
            not all(_integer(x) for x in offsets):
        raise ValueError(f"malformed header entry for {name[:100]!r}")
    if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
        raise ValueError(f"tensor {name[:100]!r} has unsupported dtype {str(dtype)[:20]}")
    begin, end = offsets
    entry = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    nbytes = entry.numel * entry.itemsize
    if nbytes >= _U64 or end < begin or end - begin != nbytes:
        raise ValueError(f"tensor {name[:100]!r}: data_offsets do not match dtype and shape")
    return entry


def parse_header(raw: bytes, data_start: int) -> tuple[dict[str, str], list[TensorEntry]]:
    """The ``__metadata__`` and tensor entries (absolute offsets from ``data_start``, sorted
    by offset) of a header's bytes; ValueError naming what the crate would refuse."""
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys,
                            parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"unreadable header ({str(exc)[:200]})") from exc
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ must map strings to strings")
    entries = [_entry(name, info, data_start) for name, info in header.items()]
    entries.sort(key=lambda e: (e.start, e.end))
    return dict(meta), entries
