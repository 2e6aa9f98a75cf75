"""A quantized exchange's codec settings: its dtype, block size, layout and error bound.

Pure Python (no numpy), so the job spec and the command line can check and describe a
quantized exchange without importing numpy; the arithmetic is :mod:`xffl.aggregator.quantize`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

QUANTIZED = ("int8", "nf4", "fp4")
SCALE_SUFFIX = ".absmax"  # tensor ``name``'s block scales are tensor ``name + SCALE_SUFFIX``
MIN_BLOCK, MAX_BLOCK = 16, 4096  # block sizes a job may choose (powers of two)
DEFAULT_BLOCK = 128

#: QLoRA's NormalFloat4 values (Dettmers et al. 2023, appendix E), index = code
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
_E2M1 = tuple(v / 6.0 for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
#: OCP FP4 (E2M1) values divided by their largest (6), index = the E2M1 bit pattern
FP4 = _E2M1 + tuple(-v for v in _E2M1)
BOOKS = {"nf4": NF4, "fp4": FP4}


def half_gap(book: tuple[float, ...]) -> float:
    """Half the largest gap between neighbouring values of a code book (of [-1, 1])."""
    values = sorted(set(book))
    return max(b - a for a, b in itertools.pairwise(values)) / 2.0


NF4_HALF_GAP = half_gap(NF4)  # (1 - 0.72296) / 2 = 0.13852
FP4_HALF_GAP = half_gap(FP4)  # (6/6 - 4/6) / 2 = 1/6


def scale_name(name: str) -> str:
    """The name of the tensor that holds ``name``'s block scales."""
    return name + SCALE_SUFFIX


def valid_block(size: int) -> bool:
    """Whether ``size`` is a block size a job may choose (a power of two, in range)."""
    return MIN_BLOCK <= size <= MAX_BLOCK and size & (size - 1) == 0


@dataclass(frozen=True)
class Codec:
    """One quantized exchange: ``dtype`` (int8, nf4 or fp4) in blocks of ``block_size``."""

    dtype: str
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.dtype not in QUANTIZED:
            raise ValueError(f"unknown quantized dtype {self.dtype!r}")
        if not valid_block(self.block_size):
            raise ValueError(f"block size {self.block_size} is not a power of two in "
                             f"[{MIN_BLOCK}, {MAX_BLOCK}]")

    @property
    def bits(self) -> int:
        """Bits per element's code."""
        return 8 if self.dtype == "int8" else 4

    @property
    def code_dtype(self) -> str:
        """The safetensors dtype of the codes."""
        return "I8" if self.dtype == "int8" else "U8"

    def code_count(self, numel: int) -> int:
        """Stored code elements of a tensor of ``numel`` elements."""
        return numel if self.bits == 8 else (numel + 1) // 2

    def blocks(self, numel: int) -> int:
        """Blocks (scales) of a tensor of ``numel`` elements."""
        return -(-numel // self.block_size)

    def nbytes(self, numel: int) -> int:
        """Bytes of a quantized tensor of ``numel`` elements, scales (float32) included."""
        return self.code_count(numel) + 4 * self.blocks(numel)

    def error_bound(self) -> float:
        """The largest error per element as a fraction of its block's absmax: int8 half a
        step (1/254), nf4 NF4_HALF_GAP, fp4 1/6 (:mod:`xffl.aggregator.quantize`)."""
        if self.dtype == "int8":
            return 1.0 / 254.0
        return NF4_HALF_GAP if self.dtype == "nf4" else FP4_HALF_GAP

    def span(self, numel: int, start: int, stop: int) -> tuple[int, int, int, int]:
        """The whole blocks that cover elements ``[start, stop)``: (first block, end block,
        first element, end element)."""
        b0 = start // self.block_size
        b1 = max(b0, math.ceil(stop / self.block_size))
        return b0, b1, b0 * self.block_size, min(numel, b1 * self.block_size)
