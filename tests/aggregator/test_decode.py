"""Encoded updates (deltas, bf16/fp16 weights) read back as the weights they stand for, by
every strategy, against numpy references computed element by element."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.decode import Decoding, encoded_index
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.shards import MODEL_FILE
from xffl.aggregator.engine import run_strategy
from xffl.aggregator.verify import UpdateRejected, check_update
from xffl.training.encode import encode_update
from xffl.aggregator.exchange_spec import ExchangeSpec

SHAPES = {"a.weight": (6, 5), "b.weight": (7,)}
SAMPLES = {"s1": 30, "s2": 50, "s3": 20}


def _global(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    path = write_checkpoint(tmp_path / "global", tensors, kind="global", site=None, round=0)
    return path, tensors


def _updates(tmp_path: Path, parent: Path, parent_t: dict[str, np.ndarray],
             exchange: ExchangeSpec) -> tuple[list[Path], dict[str, dict[str, np.ndarray]]]:
    """Three sites' trained weights (the parent plus a change of about 1e-2), encoded."""
    digest = read_manifest(parent).digest()
    dirs, weights = [], {}
    for i, site in enumerate(SAMPLES):
        rng = np.random.default_rng(10 + i)
        w = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32)
             for k, v in parent_t.items()}
        weights[site] = w
        state = encode_update({k: torch.from_numpy(v.copy()) for k, v in w.items()}, parent,
                              exchange)
        dirs.append(write_checkpoint(tmp_path / site, state, site=site,
                                     num_samples=SAMPLES[site], parent=digest))
    return dirs, weights


def _stored(path: Path) -> dict[str, np.ndarray]:
    """An update's tensors as float64 (bf16 read as its bits, widened exactly)."""
    import safetensors.torch

    return {k: v.float().numpy().astype(np.float64)
            for k, v in safetensors.torch.load_file(str(path / MODEL_FILE)).items()}


@pytest.mark.parametrize("label", ["delta/bf16", "delta/fp16", "delta/fp32", "weights/bf16"])
def test_fedavg_of_encoded_updates(tmp_path: Path, label: str) -> None:
    exchange = ExchangeSpec.parse(label)
    parent, parent_t = _global(tmp_path)
    dirs, _ = _updates(tmp_path, parent, parent_t, exchange)
    want_dtype = exchange.safetensors_dtype
    for d in dirs:  # what travels: the encoding's dtype, the global's names and shapes
        assert {t.name: t.dtype for t in read_manifest(d).tensors} == dict.fromkeys(
            SHAPES, want_dtype)
    out = tmp_path / "out"
    run_strategy("fedavg", dirs, parent, out,
                 decoding=Decoding(parent, delta=exchange.update == "delta"))
    got = load_file(str(out / MODEL_FILE))
    total = float(sum(SAMPLES.values()))
    for name, p in parent_t.items():
        # each update decoded as the aggregator does: (parent + stored) in float64, rounded
        # once to the global's fp32; then the float64 weighted mean in canonical (site) order,
        # rounded once: the same operations in the same order, so bitwise equal
        acc = np.zeros(p.shape, dtype=np.float64)
        for site, d in zip(SAMPLES, dirs, strict=True):
            x = _stored(d)[name]
            if exchange.update == "delta":
                x = x + p.astype(np.float64)
            acc += x.astype(np.float32).astype(np.float64) * SAMPLES[site]
        np.testing.assert_array_equal(got[name], (acc / total).astype(np.float32), err_msg=name)
        assert got[name].dtype == np.float32


def test_a_robust_strategy_and_clipping_see_the_weights(tmp_path: Path) -> None:
    exchange = ExchangeSpec.parse("delta/bf16")
    parent, parent_t = _global(tmp_path)
    dirs, _ = _updates(tmp_path, parent, parent_t, exchange)
    decoding = Decoding(parent, delta=True)
    out = tmp_path / "median"
    run_strategy("fedmedian", dirs, parent, out, decoding=decoding)
    got = load_file(str(out / MODEL_FILE))
    for name, p in parent_t.items():
        xs = [(_stored(d)[name] + p.astype(np.float64)).astype(np.float32) for d in dirs]
        np.testing.assert_array_equal(got[name], np.median(np.stack(xs), axis=0)
                                      .astype(np.float32), err_msg=name)
    # clip_norm measures each update's change from the parent: the stored delta's own norm
    clipped = run_strategy("fedavg", dirs, parent, tmp_path / "clip", clip_norm=1e-6,
                           decoding=decoding)
    factors = clipped.extra["bounds"]["clip_factors"]
    for site, d in zip(SAMPLES, dirs, strict=True):
        xs = {n: (v + parent_t[n].astype(np.float64)).astype(np.float32).astype(np.float64)
              - parent_t[n].astype(np.float64) for n, v in _stored(d).items()}
        norm = np.sqrt(sum(float(np.dot(v.ravel(), v.ravel())) for v in xs.values()))
        # the same float64 dot products summed in another order: within 1e-12 relative
        assert factors[site] == pytest.approx(1e-6 / norm, rel=1e-12)


def test_admission_wants_the_jobs_encoding(tmp_path: Path) -> None:
    parent, parent_t = _global(tmp_path)
    digest = read_manifest(parent).digest()
    dirs, _ = _updates(tmp_path, parent, parent_t, ExchangeSpec.parse("delta/bf16"))
    bf16 = dirs[0]
    fp32 = write_checkpoint(tmp_path / "fp32", parent_t, site="s9", parent=digest)
    reference = encoded_index(read_manifest(parent).tensors, "BF16")
    assert check_update(bf16, reference_index=reference).site == "s1"
    with pytest.raises(UpdateRejected, match="has dtype F32, the global model has BF16"):
        check_update(fp32, reference_index=reference)  # fp32 where the job sends bf16
    with pytest.raises(UpdateRejected, match="has dtype BF16, the global model has F32"):
        check_update(bf16, reference_index=read_manifest(parent).tensors)


def test_encode_update_is_the_change_in_the_exchange_dtype(tmp_path: Path) -> None:
    parent, parent_t = _global(tmp_path)
    w = {k: torch.from_numpy(v + 0.5) for k, v in parent_t.items()}
    w["steps"] = torch.tensor([3], dtype=torch.int64)  # not floating point: kept as it is
    plain = dict(w)
    assert encode_update(plain, parent, ExchangeSpec()) is plain  # fp32 weights: untouched
    out = encode_update(dict(w), parent, ExchangeSpec.parse("delta/bf16"))
    for name, p in parent_t.items():
        want = (w[name] - torch.from_numpy(p)).to(torch.bfloat16)
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], want)
    assert torch.equal(out["steps"], w["steps"])
    narrow = encode_update(dict(w), parent, ExchangeSpec.parse("weights/fp16"))
    assert torch.equal(narrow["a.weight"], w["a.weight"].to(torch.float16))
