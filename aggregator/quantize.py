"""Blockwise absmax quantization of update deltas (int8, NF4, FP4), in numpy, both ways.

A tensor is cut into blocks of ``block_size`` consecutive elements (row-major, the last
block may be shorter); each block keeps its absmax ``a`` (float32, exact: the largest
absolute value of the block's float32 elements) and every element ``x`` becomes a code:

* ``int8``: ``q = rint(127 * x / a)`` in [-127, 127], decoded ``q * a / 127``: error at most
  half a step, ``a / 254``, per element;
* ``nf4``: the index of the nearest of QLoRA's 16 NormalFloat values (Dettmers et al. 2023,
  appendix E; the values bitsandbytes uses) to ``x / a``, decoded ``NF4[i] * a``: error at
  most half the largest gap of the code book times ``a`` (``NF4_HALF_GAP * a``);
* ``fp4``: the same with the 16 values of an OCP FP4 (E2M1) element, 0, 0.5, 1, 1.5, 2, 3, 4
  and 6 and their negatives, divided by 6 (index = the E2M1 bit pattern, sign in bit 3):
  error at most ``a / 6`` (half the gap between 4/6 and 6/6).

A block of zeros has ``a = 0`` and decodes to zeros exactly. Two 4-bit codes share a byte, the
first element in the high nibble (bitsandbytes' order: on 64,002 normal values in blocks
of 64 its ``quantize_4bit(..., quant_type="nf4")`` gave the bytes and scales this module
gives). In an update's safetensors file tensor
``name`` holds the codes (``I8``, one per element, or ``U8``, one byte per two elements, flat)
and ``name.absmax`` the scales (``F32``, one per block): the global's names and shapes decide
both, so admission checks them like any other layout.

Why not a library: bitsandbytes 0.50 (a 43 MB wheel, 125 MB installed) quantizes NF4/FP4 on
CPU but its blockwise 8-bit format is a dynamic code map, not linear int8, and its packed
layout is an implementation detail of its kernels; torchao 0.18 is GPU-first (its CPU import
fails to load two of its extensions) and moved its NF4 tensor between releases. The
coordinator must decode in numpy, slice by slice, without torch, so the format is defined
here, in a few dozen lines, and pinned by tests against an independent numpy reference.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from xffl.aggregator.codec import BOOKS, Codec

Array = npt.NDArray[Any]
_CHUNK_BLOCKS = 1 << 13  # blocks quantized at a time (bounded float64 temporaries)


def quantize(codec: Codec, values: Array) -> tuple[Array, Array]:
    """(codes, scales) of a flat float array, as the update file stores them."""
    x = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    n, bsz = x.size, codec.block_size
    nb = codec.blocks(n)
    codes = np.empty(nb * bsz, dtype=np.int8 if codec.bits == 8 else np.uint8)
    scales = np.empty(nb, dtype=np.float32)
    for b0 in range(0, nb, _CHUNK_BLOCKS):
        b1 = min(nb, b0 + _CHUNK_BLOCKS)
        block = np.zeros((b1 - b0) * bsz, dtype=np.float32)
        part = x[b0 * bsz: min(n, b1 * bsz)]
        block[: part.size] = part
        rows = block.reshape(b1 - b0, bsz)
        absmax = np.max(np.abs(rows), axis=1)
        scales[b0:b1] = absmax
        ratio = rows / np.where(absmax > 0, absmax, 1.0).astype(np.float64)[:, None]
        codes[b0 * bsz: b1 * bsz] = _encode(codec, ratio).reshape(-1)
    codes = codes[:n]
    if codec.bits == 4:
        if n % 2:
            codes = np.append(codes, np.uint8(0))
        codes = (codes[0::2] << 4) | codes[1::2]
    return np.ascontiguousarray(codes), scales


def _encode(codec: Codec, ratio: Array) -> Array:
    """Codes of values in [-1, 1] (float64): the nearest level."""
    if codec.bits == 8:
        return np.clip(np.rint(ratio * 127.0), -127, 127).astype(np.int8)
    book = np.array(BOOKS[codec.dtype], dtype=np.float64)
    order = np.argsort(book, kind="stable")
    values = book[order]
    middles = (values[1:] + values[:-1]) / 2.0
    return order[np.searchsorted(middles, ratio)].astype(np.uint8)


def dequantize(codec: Codec, codes: Array, scales: Array, count: int) -> Array:
    """The first ``count`` values (float64) of whole blocks from a block boundary: ``codes``
    as stored (I8 elements or U8 bytes) and one scale per block."""
    if codec.bits == 8:
        q = codes[:count].astype(np.float64)
        factor = scales.astype(np.float64) / 127.0
    else:
        nibbles = np.empty(2 * codes.size, dtype=np.uint8)
        np.right_shift(codes, 4, out=nibbles[0::2])
        np.bitwise_and(codes, 0x0F, out=nibbles[1::2])
        q = np.array(BOOKS[codec.dtype], dtype=np.float64)[nibbles[:count]]
        factor = scales.astype(np.float64)
    per = np.repeat(factor, codec.block_size)[:count]
    out: Array = q * per
    return out
