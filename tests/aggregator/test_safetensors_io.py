"""Tests of the memmap reader, the header-first writer and the bf16 conversion."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from xffl.aggregator.safetensors_io import (
    SafetensorsReader,
    SafetensorsWriter,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
)
from xffl.core.errors import CheckpointError


def _torch_bf16_bits(values: np.ndarray) -> np.ndarray:
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_writer_round_trips_through_safetensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    arrays: dict[str, np.ndarray] = {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "b.f64": rng.standard_normal(4),
        "c.f16": rng.standard_normal((2, 2)).astype(np.float16),
        "d.ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "e.i32": np.array([-1, 7], dtype=np.int32),
        "f.scalar": np.array(2.5, dtype=np.float32),
        "g.empty": np.zeros((0, 4), dtype=np.float32),
        "h.mask": np.array([True, False, True]),
    }
    dtypes = {
        "float32": "F32",
        "float64": "F64",
        "float16": "F16",
        "int64": "I64",
        "int32": "I32",
        "bool": "BOOL",
    }
    entries = [(k, dtypes[str(v.dtype)], v.shape) for k, v in arrays.items()]
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, entries, {"format": "pt", "note": "x"}) as w:
        for k, v in arrays.items():
            w.write(k, v)
    loaded = safetensors.numpy.load_file(str(path))
    assert loaded.keys() == arrays.keys()
    for k, v in arrays.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
        np.testing.assert_array_equal(loaded[k], v)
    assert safetensors.torch.load_file(str(path))["d.ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    # header first, space padded to 8 bytes, the file's sha256 is known after close
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert hlen % 8 == 0
    header = json.loads(raw[8 : 8 + hlen])
    assert header["__metadata__"] == {"format": "pt", "note": "x"}
    assert list(k for k in header if k != "__metadata__") == list(arrays)
    import hashlib

    assert w.sha256 == hashlib.sha256(raw).hexdigest()


def test_writer_bf16_from_fp32_in_pieces(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 9)).astype(np.float32)
    path = tmp_path / "bf16.safetensors"
    with SafetensorsWriter(path, [("x", "BF16", (7, 9)), ("y", "F32", (4,))]) as w:
        flat = x.reshape(-1)
        for lo in range(0, flat.size, 10):
            w.write_chunk("x", flat[lo : lo + 10])
        w.write("y", np.arange(4, dtype=np.float64))  # float64 -> float32
    t = safetensors.torch.load_file(str(path))
    assert t["x"].dtype == torch.bfloat16
    assert torch.equal(t["x"], torch.from_numpy(x).to(torch.bfloat16))
    assert t["y"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_writer_rejects_misuse_and_removes_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    w = SafetensorsWriter(path, [("a", "F32", (2,)), ("b", "F32", (3,))])
    with pytest.raises(CheckpointError, match="expected tensor 'a' next"):
        w.write("b", np.zeros(3, np.float32))
    with pytest.raises(CheckpointError, match="shape"):
        w.write("a", np.zeros(3, np.float32))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match="too many elements"):
        w.write_chunk("b", np.zeros(4, np.float32))
    with pytest.raises(CheckpointError, match="'b' was not written"):
        w.close()
    assert not path.exists()
    with pytest.raises(RuntimeError), SafetensorsWriter(path, [("a", "F32", (1,))]):
        raise RuntimeError("boom")
    assert not path.exists()


def test_reader_reads_torch_files_one_tensor_at_a_time(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(33, 17).to(torch.bfloat16),
        "v": torch.randn(5),
        "h": torch.randn(4).half(),
    }
    path = tmp_path / "t.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    with SafetensorsReader(path) as r:
        assert r.names() == ["h", "v", "w"]
        assert r.metadata == {"format": "pt"}
        np.testing.assert_array_equal(r.read("w"), tensors["w"].float().numpy())
        np.testing.assert_array_equal(r.read("v"), tensors["v"].numpy())
        np.testing.assert_array_equal(r.read("h"), tensors["h"].numpy())
        raw = r.raw("w", 10, 20)
        assert isinstance(raw, np.memmap) and raw.dtype == np.uint16
        np.testing.assert_array_equal(
            bf16_bits_to_f32(raw), tensors["w"].float().numpy().reshape(-1)[10:20]
        )
        pieces = [np.array(c) for c in r.chunks("w", 100)]
        assert [len(p) for p in pieces] == [100] * 5 + [61]


def test_reader_detects_truncation_and_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    safetensors.numpy.save_file({"a": np.ones(100, np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsReader(path)
    path.write_bytes(data + b"\0")
    with pytest.raises(CheckpointError, match="unexpected bytes"):
        SafetensorsReader(path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        SafetensorsReader(path)


_EDGES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    float("inf"),
    float("-inf"),
    1.0 + 2.0**-8,  # tie: rounds down to even
    1.0 + 3 * 2.0**-8,  # tie: rounds up to even
    1.0 + 2.0**-8 + 2.0**-23,  # just above a tie
    3.4028234663852886e38,  # float32 max: rounds to inf
    1.1754943508222875e-38,  # smallest normal
    1.401298464324817e-45,  # smallest subnormal
    -2.350988701644575e-38,  # subnormal near the normal boundary
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
@example(_EDGES)
def test_bf16_conversion_matches_torch_bit_for_bit(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    ours = f32_to_bf16_bits(x)
    theirs = _torch_bf16_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(bf16_bits_to_f32(ours[nan])).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1).map(lambda b: np.uint32(b)))
def test_bf16_conversion_every_bit_pattern(bits: np.uint32) -> None:
    x = np.array([bits], dtype=np.uint32).view(np.float32)
    if not np.isnan(x[0]):
        assert f32_to_bf16_bits(x)[0] == _torch_bf16_bits(x)[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=True), min_size=1, max_size=32))
@example([1.0 + 2.0**-8 + 2.0**-30])  # double rounding through float32, as torch does
def test_bf16_from_float64_matches_torch(values: list[float]) -> None:
    x = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        ours = f32_to_bf16_bits(x)
    np.testing.assert_array_equal(ours, _torch_bf16_bits(x))


def test_bf16_conversion_dense_sweep_of_bit_patterns() -> None:
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    ties = (high[:, None] | lows[None, :]).reshape(-1)
    strided = np.arange(0, 1 << 32, 997, dtype=np.uint64).astype(np.uint32)
    for bits in (ties, strided):
        x = bits.view(np.float32)
        keep = ~np.isnan(x)
        np.testing.assert_array_equal(f32_to_bf16_bits(x)[keep], _torch_bf16_bits(x)[keep])
