"""Tests of streaming FedAvg against the formula sum(n_i w_i) / sum(n_i) computed in numpy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_np
from safetensors.torch import load_file as load_torch

from tests.aggregator.conftest import MakeUpdate
from xffl.aggregator import fedavg
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.safetensors_io import SafetensorsWriter
from xffl.aggregator.shards import MODEL_FILE
from xffl.core.errors import CheckpointError, InvalidInput

SHAPES = {"layers.0.w": (37, 29), "layers.0.b": (29,), "embed": (50, 8), "norm": (8,)}
SAMPLES = {"leonardo": 7, "karolina": 120, "lumi": 33}


def _fp32_updates(make_update: Any, seed: int = 0) -> tuple[list[Path], dict[str, dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    dirs, data = [], {}
    for i, (site, n) in enumerate(SAMPLES.items()):
        t = {k: rng.standard_normal(s).astype(np.float32) * (i + 1) for k, s in SHAPES.items()}
        data[site] = t
        dirs.append(
            make_update(
                site,
                t,
                num_samples=n,
                num_tokens=n * 100 + i,
                metrics={"loss": 1.0 + i, "acc": 0.5 * i},
            )
        )
    return dirs, data


def _reference(data: dict[str, dict[str, Any]], weights: dict[str, float], name: str) -> Any:
    num = sum(weights[s] * np.asarray(t[name], dtype=np.float64) for s, t in data.items())
    return num / sum(weights.values())


def _assert_fp32_average(out: Any, ref: Any, data: dict[str, dict[str, Any]], name: str) -> None:
    """``out`` (fp32) is the float64 average ``ref`` up to the rounding fedavg may do.

    fedavg sums the same 3 products in another (site) order: each float64 result is within
    (3 + 1) * 2^-53 * max|x_i| of the exact average (a product, sum or division rounds by
    2^-53), so the two differ by <= 8 * 2^-53 * max|x_i|; fedavg then rounds to fp32,
    <= 2^-24 relative. Hence rtol 2^-23 and atol 16 * 2^-53 * max|x_i| (both 2x). A wrong
    weight or a site left out moves the average by ~0.1 of the inputs' scale.
    """
    xmax = max(float(np.abs(t[name]).max()) for t in data.values())
    np.testing.assert_allclose(out, ref, rtol=2**-23, atol=16 * 2**-53 * xmax, err_msg=name)


def test_fp32_matches_formula(make_update: Any, tmp_path: Path) -> None:
    dirs, data = _fp32_updates(make_update)
    m = aggregate(dirs, tmp_path / "global", run_id="run-1", round=1, parent_digest=None)
    out = load_np(str(tmp_path / "global" / MODEL_FILE))
    assert sorted(out) == sorted(SHAPES)
    for name, shape in SHAPES.items():
        assert out[name].dtype == np.float32 and out[name].shape == shape
        ref = _reference(data, {s: float(n) for s, n in SAMPLES.items()}, name)
        _assert_fp32_average(out[name], ref, data, name)
    assert verify_checkpoint(tmp_path / "global") == m
    assert m.kind == "global" and m.round == 1 and m.run_id == "run-1"
    assert m.num_samples == 160 and m.num_tokens == 16000 + 1 + 2
    total = sum(SAMPLES.values())
    # The products n_i * loss_i are small integers, so math.fsum is exact and both sides
    # divide 346 by 160 once, correctly rounded: equal bit for bit; so is 120 / 160.
    assert m.metrics["loss"] == (7 * 1 + 120 * 2 + 33 * 3) / total
    sites = m.extra["sites"]
    assert set(sites) == set(SAMPLES)
    assert sites["karolina"]["weight"] == 120 / total
    assert sites["lumi"]["num_tokens"] == 3302 and sites["lumi"]["metrics"]["loss"] == 3.0
    assert sites["leonardo"]["digest"] == read_manifest(dirs[0]).digest()
    assert json.loads((tmp_path / "global" / "config.json").read_text()) == {"hidden_size": 8}


def test_bf16_equals_reference_rounded_to_bf16(make_update: Any, tmp_path: Path) -> None:
    torch.manual_seed(3)
    data: dict[str, dict[str, Any]] = {}
    dirs = []
    for site, n in SAMPLES.items():
        t = {k: torch.randn(s).to(torch.bfloat16) for k, s in SHAPES.items()}
        data[site] = {k: v.float().numpy() for k, v in t.items()}
        dirs.append(make_update(site, t, num_samples=n))
    aggregate(dirs, tmp_path / "g")
    out = load_torch(str(tmp_path / "g" / MODEL_FILE))
    for name in SHAPES:
        ref = _reference(data, {s: float(n) for s, n in SAMPLES.items()}, name)
        expected = torch.from_numpy(ref).to(torch.bfloat16)
        assert out[name].dtype == torch.bfloat16
        assert torch.equal(out[name].view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("small_slices", [False, True])
def test_result_is_bitwise_independent_of_input_order(
    make_update: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_slices: bool
) -> None:
    if small_slices:  # exercise slice and block boundaries inside tensors
        monkeypatch.setattr(fedavg, "SLICE_ELEMENTS", 96)
        monkeypatch.setattr(fedavg, "BLOCK_ELEMENTS", 20)
    dirs, _ = _fp32_updates(make_update)
    results = set()
    for i, order in enumerate([[0, 1, 2], [2, 0, 1], [1, 2, 0], [2, 1, 0]]):
        aggregate([dirs[j] for j in order], tmp_path / f"g{i}")
        results.add((tmp_path / f"g{i}" / MODEL_FILE).read_bytes())
    assert len(results) == 1


def test_small_slices_equal_default_slices(
    make_update: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs, _ = _fp32_updates(make_update)
    aggregate(dirs, tmp_path / "a")
    monkeypatch.setattr(fedavg, "SLICE_ELEMENTS", 64)
    monkeypatch.setattr(fedavg, "BLOCK_ELEMENTS", 24)
    aggregate(dirs, tmp_path / "b")
    a, b = ((tmp_path / d / MODEL_FILE).read_bytes() for d in "ab")
    assert a == b


@pytest.mark.parametrize(
    ("kwargs", "weights"),
    [
        ({"weighting": "tokens"}, {"leonardo": 700.0, "karolina": 12001.0, "lumi": 3302.0}),
        ({"weighting": "uniform"}, {"leonardo": 1.0, "karolina": 1.0, "lumi": 1.0}),
        (
            {"weighting": {"leonardo": 2.0, "karolina": 0.0, "lumi": 1.0}},
            {"leonardo": 2.0, "karolina": 0.0, "lumi": 1.0},
        ),
        ({"weights": [0.5, 0.25, 0.25]}, {"leonardo": 0.5, "karolina": 0.25, "lumi": 0.25}),
    ],
)
def test_weighting_modes(
    make_update: Any, tmp_path: Path, kwargs: dict[str, Any], weights: dict[str, float]
) -> None:
    dirs, data = _fp32_updates(make_update)
    m = aggregate(dirs, tmp_path / "g", **kwargs)
    out = load_np(str(tmp_path / "g" / MODEL_FILE))
    for name in SHAPES:
        _assert_fp32_average(out[name], _reference(data, weights, name), data, name)
    total = sum(weights.values())
    # fedavg divides each weight by their math.fsum, here an exact sum (integers, or
    # 0.5 + 0.25 + 0.25): the same one division as here, bit for bit
    for site, w in weights.items():
        assert m.extra["sites"][site]["weight"] == w / total


def test_integer_tensors_take_the_rounded_weighted_mean(make_update: Any, tmp_path: Path) -> None:
    a = make_update("a", {"steps": np.array([10, 20], dtype=np.int64)}, num_samples=1)
    b = make_update("b", {"steps": np.array([10, 40], dtype=np.int64)}, num_samples=3)
    aggregate([a, b], tmp_path / "g")
    assert load_np(str(tmp_path / "g" / MODEL_FILE))["steps"].tolist() == [10, 35]


def test_bad_inputs_raise(make_update: Any, tmp_path: Path) -> None:
    a = make_update("a", {"w": np.ones(3, np.float32)}, num_samples=0)
    b = make_update("b", {"w": np.ones(3, np.float32)}, num_samples=0)
    with pytest.raises(InvalidInput, match="all weights are zero"):
        aggregate([a, b], tmp_path / "g")
    with pytest.raises(InvalidInput, match="no weight given for site"):
        aggregate([a, b], tmp_path / "g", weighting={"a": 1.0})
    c = make_update("c", {"w": np.ones(4, np.float32)}, num_samples=1)
    with pytest.raises(CheckpointError, match=r"site 'c'.*shape \[4\]"):
        aggregate([a, c], tmp_path / "g", weighting="uniform")
    d = make_update("d", {"w": np.ones(3, np.float32)}, config={"hidden_size": 9})
    with pytest.raises(CheckpointError, match=r"config\.json of site 'd' differs"):
        aggregate([a, d], tmp_path / "g", weighting="uniform")
    e = make_update("e", {"w": np.ones(3, np.float32)}, round=2)
    with pytest.raises(CheckpointError, match=r"site 'e'.*round 2, expected 1"):
        aggregate([a, e], tmp_path / "g", weighting="uniform", round=1)
    dup = make_update("a", {"w": np.ones(3, np.float32)}, dirname="a-again")
    with pytest.raises(CheckpointError, match="more than one update from site"):
        aggregate([a, dup], tmp_path / "g", weighting="uniform")
    assert not (tmp_path / "g").exists()


def test_failed_aggregation_leaves_no_output_and_keeps_previous(
    make_update: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs, _ = _fp32_updates(make_update)
    previous = tmp_path / "prev"
    aggregate(dirs[:2], previous)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    calls = {"n": 0}
    real = SafetensorsWriter.write_chunk

    def failing(self: SafetensorsWriter, name: str, array: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(self, name, array)

    monkeypatch.setattr(SafetensorsWriter, "write_chunk", failing)
    for target in (tmp_path / "fresh", previous):
        calls["n"] = 0
        with pytest.raises(OSError, match="No space left"):
            aggregate(dirs, target)
    assert not (tmp_path / "fresh").exists()
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prev", "updates"]


def test_empty_and_scalar_tensors(make_update: Any, tmp_path: Path) -> None:
    a = make_update("a", {"e": np.zeros((0, 3), np.float32), "s": np.array(1.0, np.float32)})
    b = make_update("b", {"e": np.zeros((0, 3), np.float32), "s": np.array(4.0, np.float32)})
    aggregate([a, b], tmp_path / "g", weighting="uniform")
    out = load_np(str(tmp_path / "g" / MODEL_FILE))
    assert out["e"].shape == (0, 3) and out["s"].shape == () and float(out["s"]) == 2.5


def test_read_buffers_do_not_grow_with_the_number_of_updates() -> None:
    budget = fedavg.READ_BUDGET_ELEMENTS
    for n in (4, 8, 16, 32):
        assert n * fedavg.slice_elements(n) == budget
    assert fedavg.slice_elements(1) == fedavg.SLICE_ELEMENTS  # capped
    assert fedavg.slice_elements(10**6) == fedavg.MIN_SLICE_ELEMENTS  # floored


def test_result_is_independent_of_the_read_budget(
    make_update: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs, _ = _fp32_updates(make_update)
    aggregate(dirs, tmp_path / "a")
    monkeypatch.setattr(fedavg, "READ_BUDGET_ELEMENTS", 150)
    monkeypatch.setattr(fedavg, "MIN_SLICE_ELEMENTS", 16)
    aggregate(dirs, tmp_path / "b")
    a, b = ((tmp_path / d / MODEL_FILE).read_bytes() for d in "ab")
    assert a == b


def test_validation_numbers_stay_out_of_the_aggregate(tmp_path: Path,
                                                     make_update: MakeUpdate) -> None:
    """A site's validation loss measures the round's incoming global on its held-out data:
    the global's manifest averages the training metrics only (the federated validation
    loss, weighted by held-out targets in the loss, is the aggregate step's)."""
    ups = [make_update(f"s{i}", {"w": np.full(3, float(i), np.float32)}, num_samples=1 + i,
                       metrics={"loss": loss, "val_loss": val, "val_loss_update": val,
                                "val_samples": 8.0, "val_tokens": 64.0,
                                "eval_seconds": 0.5})
           for i, (loss, val) in enumerate(((2.0, 3.0), (4.0, 5.0)))]
    out = tmp_path / "global"
    aggregate(ups, out)
    metrics = read_manifest(out).metrics
    assert metrics["loss"] == (1 * 2.0 + 2 * 4.0) / 3
    assert not {"val_loss", "val_loss_update", "val_samples", "val_tokens",
                "eval_seconds"} & set(metrics)
