"""Blockwise absmax quantization (int8, nf4, fp4) against a numpy reference written here from
the formats' definitions, within the derived error bound; the coordinator's slice-by-slice
decoding of a quantized delta."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.codec import Codec, scale_name
from xffl.aggregator.decode import DecodedReader, encoded_index
from xffl.aggregator.exchange import index_of, read_manifest
from xffl.aggregator.quantize import dequantize, quantize
from xffl.aggregator.shards import open_model

# The code books as the papers give them (not xffl's tables): QLoRA appendix E (NF4), and the
# OCP Microscaling spec's FP4 E2M1 element (bit pattern s e1 e0 m: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
# normalised by its largest value.
PAPER_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
             -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
             0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
             0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def e2m1(bits: int) -> float:
    """An E2M1 bit pattern's value: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if bits & 8 else 1.0
    exp, man = (bits >> 1) & 3, bits & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


PAPER_FP4 = [e2m1(b) / 6.0 for b in range(16)]


def reference_decode(kind: str, block: int, codes: np.ndarray, scales: np.ndarray,
                     numel: int) -> np.ndarray:
    """Element by element, from the stored bytes: element i is in block i // block; int8
    is code * absmax / 127; 4-bit element i is nibble i % 2 (high first) of byte i // 2."""
    out = np.empty(numel)
    for i in range(numel):
        a = float(scales[i // block])
        if kind == "int8":
            out[i] = int(codes[i]) * a / 127.0
        else:
            byte = int(codes[i // 2])
            nibble = byte >> 4 if i % 2 == 0 else byte & 15
            out[i] = (PAPER_NF4 if kind == "nf4" else PAPER_FP4)[nibble] * a
    return out


def bound(kind: str) -> float:
    """The error per element, as a fraction of the block's absmax a, from the code books:
    int8 rounds 127 x/a to the nearest integer (off by <= 1/2 step of a/127: a/254); a
    4-bit code is the nearest level, off by at most half the widest gap between levels:
    NF4's is between 0.7229568 and 1.0, FP4's between 4/6 and 6/6."""
    if kind == "int8":
        return 1 / 254
    levels = sorted(set(PAPER_NF4 if kind == "nf4" else PAPER_FP4))
    return max(b - a for a, b in itertools.pairwise(levels)) / 2


def _sample(numel: int, seed: int) -> np.ndarray:
    """Values of very different sizes per block, a block of zeros and a lone spike."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(numel) * np.exp(rng.uniform(-12, 3, numel))).astype(np.float32)
    x[16:48] = 0.0
    x[numel // 2] = 1e4
    return x


@pytest.mark.parametrize("kind", ["int8", "nf4", "fp4"])
@pytest.mark.parametrize("block", [16, 128])
def test_codec_against_the_reference_within_the_blockwise_bound(kind: str, block: int) -> None:
    codec = Codec(kind, block)
    x = _sample(1001, seed=block)  # odd: a partial last block and a half-filled last byte
    codes, scales = quantize(codec, x)
    assert codes.size == codec.code_count(x.size) and scales.size == math.ceil(x.size / block)
    want = reference_decode(kind, block, codes, scales, x.size)
    got = dequantize(codec, codes, scales, x.size)
    # both are one float64 product of the same two numbers (int8: code * (a/127) here,
    # (code * a)/127 in the reference): they differ by at most 2 float64 roundings
    assert np.allclose(got, want, rtol=4 * 2.0**-53, atol=0)
    absmax = np.array([np.abs(x[i:i + block]).max() for i in range(0, x.size, block)],
                      dtype=np.float64)
    assert np.array_equal(scales, absmax)  # the absmax of float32 values is exact
    per = np.repeat(absmax, block)[: x.size]
    err = np.abs(x.astype(np.float64) - got)
    # the bound plus float64 rounding of x / a (2^-52 relative, times a): tight enough that
    # truncating instead of rounding (int8 error up to a/127) or a code one level off fails
    assert np.all(err <= per * (bound(kind) + 2.0**-50)), (kind, float((err / per).max()))
    assert np.all(got[16:48] == 0)  # a block of zeros decodes to zeros exactly
    if kind != "int8":  # every code is the nearest level: no other level is closer
        book = np.array(PAPER_NF4 if kind == "nf4" else PAPER_FP4)
        ratio = np.divide(x, per, out=np.zeros(x.size), where=per > 0)
        best = np.abs(ratio[:, None] - book[None, :]).min(axis=1) * per
        assert np.all(err <= best + per * 2.0**-50)


def _delta_checkpoint(tmp_path: Path, codec: Codec, values: dict[str, np.ndarray]) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for name, v in values.items():
        codes, scales = quantize(codec, v)
        tensors[name] = torch.from_numpy(codes)
        tensors[scale_name(name)] = torch.from_numpy(scales)
    return write_checkpoint(tmp_path / "update", tensors)


def test_decoded_reader_reads_any_slice_of_a_quantized_delta(tmp_path: Path) -> None:
    codec = Codec("nf4", 16)
    rng = np.random.default_rng(1)
    base = {"w": rng.standard_normal((7, 13)).astype(np.float32),
            "b": rng.standard_normal(21).astype(np.float32)}
    delta = {k: (0.01 * rng.standard_normal(v.shape)).astype(np.float32).reshape(-1)
             for k, v in base.items()}
    glob = write_checkpoint(tmp_path / "global", {k: torch.from_numpy(v) for k, v in base.items()},
                            kind="global", site=None, round=0)
    update = _delta_checkpoint(tmp_path, codec, delta)
    expected = encoded_index(read_manifest(glob).tensors, "U8", codec)
    assert index_of(open_model(update)) == expected  # what admission compares the update to
    with DecodedReader(open_model(update), open_model(glob), delta=True, codec=codec) as r:
        for name, v in base.items():
            codes, scales = quantize(codec, delta[name])
            whole = (v.reshape(-1).astype(np.float64)
                     + dequantize(codec, codes, scales, v.size)).astype(np.float32)
            assert np.array_equal(r.raw(name), whole)
            for lo, hi in [(0, 1), (3, v.size - 1), (17, 18), (v.size - 3, v.size)]:
                assert np.array_equal(r.raw(name, lo, hi), whole[lo:hi]), (name, lo, hi)
