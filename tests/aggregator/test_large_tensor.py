"""Issue acceptance: a bf16 model with one tensor larger than 2 GiB aggregates correctly.

The updates are written and checked chunk by chunk, so the test never holds a whole tensor.
Chunk k of every update is the same rotation of that update's base chunk, so the expected
chunk k is that rotation of the weighted mean of the base chunks (computed once, in float64,
element by element, then rounded to bf16 by the module's own f32 -> bf16 conversion).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from xffl.aggregator.exchange import Manifest, finalize_manifest, staged_dir
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.safetensors_io import (
    SafetensorsReader,
    SafetensorsWriter,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
)
from xffl.aggregator.shards import MODEL_FILE

BIG = "model.embed.weight"
SMALL = "model.norm.weight"
ROWS, COLS = 2**15, 33_570  # 1_100_021_760 elements: 2.05 GiB of bf16
CHUNK = 1 << 22  # elements per chunk (8 MiB of bf16)
SAMPLES = {"site-a": 300, "site-b": 1100}


def _base(seed: int) -> np.ndarray:
    """bf16 bits of one chunk's worth of normal values, from a fixed seed."""
    values = np.random.default_rng(seed).standard_normal(CHUNK, dtype=np.float32)
    return f32_to_bf16_bits(values)


def _twice(base: np.ndarray) -> np.ndarray:
    """``base`` twice in a row: every rotation of it is a view of this (see _chunk)."""
    return np.concatenate([base, base])


def _chunk(twice: np.ndarray, k: int, n: int) -> np.ndarray:
    """Chunk ``k`` (``n`` elements): the base bits rotated by an amount fixed by ``k``, as
    ``np.roll(base, k * 7919 + 1)[:n]``, but a view of ``_twice(base)`` (no 8 MiB copy per
    chunk: np.roll(a, s)[i] = a[(i - s) mod N] = twice[N - s + i])."""
    start = -(k * 7919 + 1) % CHUNK
    return twice[start:start + n]


def _small(seed: int) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((7, 5)).astype(np.float32)


def _write_update(directory: Path, site: str, seed: int) -> Path:
    numel = ROWS * COLS
    base = _twice(_base(seed))
    entries = [(BIG, "BF16", (ROWS, COLS)), (SMALL, "F32", (7, 5))]
    with staged_dir(directory) as tmp:
        with SafetensorsWriter(tmp / MODEL_FILE, entries, {"format": "pt"}) as w:
            for k, lo in enumerate(range(0, numel, CHUNK)):
                w.write_chunk(BIG, _chunk(base, k, min(CHUNK, numel - lo)))
            w.write(SMALL, _small(seed))
        (tmp / "config.json").write_text('{"hidden_size": 8}')
        finalize_manifest(
            tmp,
            Manifest(kind="update", run_id="run-1", round=1, site=site, num_samples=SAMPLES[site]),
            checksums={MODEL_FILE: w.sha256},
        )
    return directory


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """Where the 6 GiB of this test go: RAM (/dev/shm) when it has room, else tmp_path.

    The aggregation's arithmetic is under test, not the disk: on this class of machine,
    writing back 6 GiB of dirty pages took a third of the test's time.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 8 * 2**30:
        folder = Path(tempfile.mkdtemp(prefix="xffl-large-tensor-", dir=shm))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:
        yield tmp_path


@pytest.mark.slow
def test_bf16_tensor_over_2_gib_aggregates_correctly(scratch: Path) -> None:
    tmp_path = scratch
    numel = ROWS * COLS
    assert numel * 2 > 2**31
    dirs = [_write_update(tmp_path / site, site, seed) for seed, site in enumerate(SAMPLES)]
    out = tmp_path / "global"
    try:
        aggregate(dirs, out)
        wa, wb = (float(n) for n in SAMPLES.values())
        total = wa + wb
        xa, xb = (bf16_bits_to_f32(_base(seed)).astype(np.float64) for seed in (0, 1))
        expected = _twice(f32_to_bf16_bits(((xa * wa + xb * wb) / total).astype(np.float32)))
        del xa, xb
        got = np.empty(CHUNK, dtype=np.uint16)
        with SafetensorsReader(out / MODEL_FILE) as r:
            big = r.entry(BIG)
            assert big.dtype == "BF16"
            assert big.shape == (ROWS, COLS)
            assert big.end - r.data_start > 2**31  # header data_offsets past 2 GiB
            for k, lo in enumerate(range(0, numel, CHUNK)):
                n = min(CHUNK, numel - lo)
                r.read_into(BIG, lo, got[:n])
                if not np.array_equal(got[:n], _chunk(expected, k, n)):  # the message: once
                    np.testing.assert_array_equal(got[:n], _chunk(expected, k, n),
                                                  err_msg=f"chunk {k}")
            small = (_small(0).astype(np.float64) * wa + _small(1).astype(np.float64) * wb) / total
            np.testing.assert_array_equal(r.read(SMALL), small.astype(np.float32))
    finally:
        for d in (*dirs, out):
            shutil.rmtree(d, ignore_errors=True)
