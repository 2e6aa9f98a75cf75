"""safetensors dtypes as numpy storage types, and bf16 <-> float32 conversion matching torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from xffl.core.errors import CheckpointError

Array = npt.NDArray[Any]

#: safetensors dtype string -> numpy storage dtype (little endian). BF16 is stored as raw bits.
STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_BF16_NAN = np.uint16(0xFFFF)  # what torch's CPU conversion produces for every NaN


def bf16_bits_to_f32(bits: Array, out: Array | None = None) -> Array:
    """Decode raw bf16 bits (uint16) to float32 by moving them into the high half of a word."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    np.left_shift(bits, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


def f32_to_bf16_bits(values: Array, out: Array | None = None) -> Array:
    """Encode floats as bf16 bits, rounding to nearest even (float64 via float32, like torch)."""
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    u32 = f32.view(np.uint32)
    tmp = np.right_shift(u32, np.uint32(16))
    np.bitwise_and(tmp, np.uint32(1), out=tmp)
    np.add(tmp, np.uint32(0x7FFF), out=tmp)
    np.add(tmp, u32, out=tmp)  # wraps only for NaN bit patterns, which are replaced below
    np.right_shift(tmp, np.uint32(16), out=tmp)
    if out is None:
        out = np.empty(f32.shape, dtype=np.uint16)
    np.copyto(out, tmp, casting="unsafe")
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = _BF16_NAN
    return out


def to_storage(values: Array, dtype: str) -> Array:
    """Convert an array to the little-endian storage representation of a safetensors dtype."""
    target = storage_dtype(dtype)
    arr = np.asarray(values)
    if dtype == "BF16":
        if arr.dtype == np.uint16:
            return np.ascontiguousarray(arr)  # already raw bf16 bits
        if arr.dtype.kind != "f":
            raise CheckpointError(f"cannot store {arr.dtype} values as BF16.")
        return f32_to_bf16_bits(arr)
    if dtype == "F16" and arr.dtype == np.float64:
        arr = arr.astype(np.float32)  # double rounding through float32, as torch does
    if arr.dtype.kind == "f" and target.kind not in "f":
        raise CheckpointError(f"cannot store {arr.dtype} values as {dtype}.")
    return np.ascontiguousarray(arr.astype(target, casting="unsafe", copy=False))


def storage_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy storage dtype of a safetensors dtype string (CheckpointError if unknown)."""
    try:
        return STORAGE_DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"unsupported safetensors dtype {dtype!r}.") from None


def decode(raw: Array, dtype: str) -> Array:
    """Storage elements (bf16 as its bit pattern) as float64."""
    if dtype == "BF16":
        raw = bf16_bits_to_f32(raw)
    return raw.astype(np.float64)


def encode(acc: Array, dtype: str, out: Array, scratch: Array) -> None:
    """Cast a float64 block into ``out`` (storage dtype), rounding like torch's .to(dtype).

    The inverse of :func:`decode`; ``scratch`` is a float32 buffer of the same length.
    Integer and bool tensors get the value rounded half to even (``acc`` is rounded in
    place).
    """
    if dtype == "BF16":
        np.copyto(scratch, acc, casting="same_kind")
        f32_to_bf16_bits(scratch, out=out)
    elif dtype == "F16":
        np.copyto(scratch, acc, casting="same_kind")
        np.copyto(out, scratch, casting="same_kind")
    elif dtype in FLOAT_DTYPES:
        np.copyto(out, acc, casting="same_kind")
    else:  # integer and bool tensors: weighted mean rounded half to even
        np.rint(acc, out=acc)
        np.copyto(out, acc, casting="unsafe")
