"""The running aggregate equals xffl's streaming FedAvg, with memory independent of N."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.inputs import update_weight
from xffl.aggregator.running import RunningAggregate
from xffl.aggregator.shards import open_model
from xffl.core.errors import CheckpointError, InvalidInput

# every dtype family the aggregator supports (aggregator/dtypes.py): floats, bf16, integers
DTYPES = {"w.f32": torch.float32, "w.bf16": torch.bfloat16, "w.f16": torch.float16,
          "w.f64": torch.float64, "count.i64": torch.int64, "mask.i32": torch.int32}
SHAPES = {"w.f32": (37, 29), "w.bf16": (50, 8), "w.f16": (13,), "w.f64": (6, 5),
          "count.i64": (4,), "mask.i32": (3, 3)}


def _tensors(rng: np.random.Generator, scale: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype in DTYPES.items():
        if dtype.is_floating_point:
            values = rng.standard_normal(SHAPES[name]) * scale
            out[name] = torch.from_numpy(values).to(dtype)
        else:
            out[name] = torch.from_numpy(rng.integers(-1000, 1000, SHAPES[name])).to(dtype)
    return out


def _updates(make_update: Any, count: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    return [
        make_update(f"site-{i:03d}", _tensors(rng, 1.0 + i), num_samples=int(rng.integers(1, 500)),
                    num_tokens=int(rng.integers(1, 10_000)), parent="p" * 64,
                    metrics={"loss": float(rng.uniform(1, 5)), "train_seconds": 1.0 + i})
        for i in range(count)
    ]


def _running(dirs: list[Path], out: Path, weighting: str = "samples", **kw: Any) -> Any:
    agg = RunningAggregate(read_manifest(dirs[0]).tensors)
    for d in reversed(dirs):  # arrival order differs from fedavg's canonical (site) order
        m = read_manifest(d)
        agg.add(d, update_weight(m, weighting), m)  # type: ignore[arg-type]
    return agg, agg.write(out, run_id="run-1", round=1, parent="p" * 64, **kw)


def _decoded(directory: Path) -> dict[str, np.ndarray]:
    with open_model(directory) as reader:
        return {name: np.asarray(reader.read(name)) for name in reader.names()}


def _assert_same_average(got: Path, want: Path, dirs: list[Path]) -> None:
    """The running aggregate's tensors == fedavg's, to the rounding the two orders allow.

    Both compute sum_i w_i x_i / sum_i w_i in float64 (IEEE, so the same on every CPU) and
    round it once to the stored dtype; only the order of the n <= 7 additions differs.
    float64: each result is within (n + 1) * 2^-53 * max|x_i| of the exact average, so
    they differ by <= 16 * 2^-53 * max|x_i|. bf16 and f16: every product w_i x_i is exact
    in float64 (<= 11 significant bits times an integer weight < 2^14) and so is every
    partial sum (all terms are multiples of 2^-24, the smallest f16 step, and of 2^-20 for
    bf16, whose inputs here are >= 2.7e-4 in magnitude, and all sums are < 2^21), so the
    results are equal bit for bit. fp32: the float64 values differ by far less than an fp32
    ulp and are rounded once, so they are equal or adjacent: <= 1 ulp of max|y|. Integers
    are rounded from the same float64 values: equal. A weight off by one sample moves a
    tensor by ~1e-3 of its scale, far above any of these.
    """
    a, b = _decoded(got), _decoded(want)
    inputs = [_decoded(d) for d in dirs]
    assert sorted(a) == sorted(b) == sorted(DTYPES)
    for name, x in a.items():
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape
        if DTYPES[name] == torch.float64:
            xmax = max(float(np.abs(t[name]).max()) for t in inputs)
            assert float(np.abs(x - y).max()) <= 16 * 2**-53 * xmax, name
        elif DTYPES[name] == torch.float32:
            tol = float(np.spacing(np.float32(np.abs(y).max())))
            assert float(np.abs(x.astype(np.float64) - y).max()) <= tol, name
        else:  # bf16 (decoded to fp32), f16, integers: bitwise equal
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("weighting", ["samples", "tokens", "uniform"])
def test_equals_fedavg(make_update: Any, tmp_path: Path, weighting: str) -> None:
    dirs = _updates(make_update, 7)
    ref = aggregate(dirs, tmp_path / "fedavg", weighting=weighting)  # type: ignore[arg-type]
    _, got = _running(dirs, tmp_path / "running", weighting)
    assert verify_checkpoint(tmp_path / "running") == got
    _assert_same_average(tmp_path / "running", tmp_path / "fedavg", dirs)
    assert got.tensors == ref.tensors
    assert (got.num_samples, got.num_tokens) == (ref.num_samples, ref.num_tokens)
    # weighted means of 7 positive metrics: a running float64 sum (7 products and 6
    # additions, each within 2^-53: <= 13 * 2^-53 relative) against fedavg's math.fsum of
    # the products (<= 2 * 2^-53), each divided once: <= 17 * 2^-53 = 1.9e-15 apart
    # relative: rel 4e-15 (a site's metric left out is off by > 1e-2)
    assert got.metrics == pytest.approx(ref.metrics, rel=4e-15, abs=0)
    assert (tmp_path / "running" / "config.json").read_bytes() == \
        (tmp_path / "fedavg" / "config.json").read_bytes()
    assert got.kind == "global" and got.parent == "p" * 64 and got.extra["updates"] == 7


def test_sharded_output_equals_fedavg(make_update: Any, tmp_path: Path) -> None:
    dirs = _updates(make_update, 3, seed=1)
    aggregate(dirs, tmp_path / "fedavg", max_shard_size=2000)
    _, got = _running(dirs, tmp_path / "running", max_shard_size=2000)
    assert "model.safetensors.index.json" in got.files
    assert sorted(got.files) == sorted(read_manifest(tmp_path / "fedavg").files)
    verify_checkpoint(tmp_path / "running")
    _assert_same_average(tmp_path / "running", tmp_path / "fedavg", dirs)


def test_memory_does_not_depend_on_the_number_of_updates(make_update: Any) -> None:
    dirs = _updates(make_update, 24, seed=2)
    layout = read_manifest(dirs[0]).tensors
    agg = RunningAggregate(layout)
    # exactly one float64 accumulator per tensor, of the tensor's size
    assert sorted(agg.sums) == sorted(t.name for t in layout)
    for t in layout:
        acc = agg.sums[t.name]
        assert acc.dtype == np.float64 and acc.size == int(np.prod(t.shape))
    agg.add(dirs[0], 1.0)
    agg.add(dirs[1], 2.0)
    held = agg.nbytes
    tracemalloc.start()
    try:
        agg.add(dirs[2], 3.0)
        after_one, _ = tracemalloc.get_traced_memory()
        for d in dirs[3:]:
            agg.add(d, 1.5)
        after_all, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert agg.nbytes == held and agg.count == 24
    assert after_all - after_one < 16 << 10  # 21 more updates folded: no per-update growth
    assert all(a.dtype == np.float64 for a in agg.sums.values())


def test_rejects_a_different_layout_or_config(make_update: Any, write_ckpt: Any,
                                              tmp_path: Path) -> None:
    (first,) = _updates(make_update, 1)
    agg = RunningAggregate(read_manifest(first).tensors)
    agg.add(first, 1.0)
    rng = np.random.default_rng(3)
    other = _tensors(rng, 1.0)
    other["w.f32"] = torch.zeros(37, 28)
    bad = write_ckpt(tmp_path / "bad", other, site="bad")
    with pytest.raises(CheckpointError, match=r"w\.f32"):
        agg.add(bad, 1.0)
    odd = write_ckpt(tmp_path / "odd", _tensors(rng, 1.0), site="odd",
                     config={"hidden_size": 16})
    with pytest.raises(CheckpointError, match=r"config\.json"):
        agg.add(odd, 1.0)
    with pytest.raises(InvalidInput, match="weights must be"):
        agg.add(first, float("nan"))
    assert agg.count == 1


def test_nothing_to_write(make_update: Any, tmp_path: Path) -> None:
    (first,) = _updates(make_update, 1)
    agg = RunningAggregate(read_manifest(first).tensors)
    with pytest.raises(InvalidInput, match="no updates"):
        agg.write(tmp_path / "g", run_id="r", round=1, parent=None)
    agg.add(first, 0.0)
    with pytest.raises(InvalidInput, match="all weights are zero"):
        agg.write(tmp_path / "g", run_id="r", round=1, parent=None)
    assert not (tmp_path / "g").exists()
