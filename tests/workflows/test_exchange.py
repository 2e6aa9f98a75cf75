"""The error a bf16 delta adds to each round's global, bounded on the quickstart's own
trained updates (a real run with bf16 deltas: tests/workflows/test_wiring.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import FinishedRun
from xffl.aggregator.decode import Decoding
from xffl.aggregator.engine import run_strategy
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.shards import MODEL_FILE
from xffl.training.encode import encode_update

U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits), round to nearest
U_FP32 = 2.0**-24


def _widened(path: Path) -> dict[str, np.ndarray]:
    """A checkpoint's tensors as float64, exactly (bf16 through torch's float32)."""
    import safetensors.torch

    return {k: v.float().numpy().astype(np.float64)
            for k, v in safetensors.torch.load_file(str(path / MODEL_FILE)).items()}


@pytest.mark.slow  # the quickstart's run (session fixture): a real StreamFlow workflow
def test_bf16_delta_globals_within_the_bound(tmp_path: Path,
                                            quickstart_run: FinishedRun) -> None:
    """Each round of the quickstart (fp32 weights) aggregated again from the same trained
    updates sent as bf16 deltas: every element of the global is within the bound derived
    below (and in docs/aggregation.md) of the fp32 run's global.

    Two separate runs cannot be compared past round 1: from round 2 on they train from
    different globals, and training amplifies any difference without a bound.
    """
    run_dir = Path(quickstart_run.status["run_dir"])
    exchange = ExchangeSpec.parse("delta/bf16")
    worst = 0.0
    for r in (1, 2, 3):
        parent = run_dir / "rounds" / str(r - 1) / "global"
        reference = run_dir / "rounds" / str(r) / "global"
        sites = sorted(p.name for p in (run_dir / "rounds" / str(r) / "updates").iterdir())
        encoded = []
        for site in sites:  # the fp32 update, encoded as the trainer would send it
            src = run_dir / "rounds" / str(r) / "updates" / site
            m = read_manifest(src)
            state = {k: torch.from_numpy(v.astype(np.float32))
                     for k, v in _widened(src).items()}
            encoded.append(write_checkpoint(
                tmp_path / f"r{r}" / site, encode_update(state, parent, exchange), site=site,
                num_samples=m.num_samples, num_tokens=m.num_tokens, round=r, parent=m.parent,
                run_id=m.run_id, config=json.loads((src / "config.json").read_text())))
        out = tmp_path / f"r{r}" / "global"
        run_strategy("fedavg", encoded, parent, out, decoding=Decoding(parent, delta=True))
        p, g, g2 = _widened(parent), _widened(reference), _widened(out)
        total = float(sum(read_manifest(e).num_samples for e in encoded))
        omega = [read_manifest(e).num_samples / total for e in encoded]
        deltas = [_widened(e) for e in encoded]
        for name in p:
            # Per site i: d_i = fl32(w_i - p) (|err| <= 2^-24 |d_i|), sent as bf16(d_i)
            # (|err| <= 2^-8 |d_i| <= 2^-8 (1 + 2^-7) |bf16(d_i)|); the coordinator's
            # x_i = fl32(p + bf16(d_i)) (|err| <= 2^-24 (|p| + |bf16(d_i)|)). Both globals
            # are float64 means rounded once to fp32 (2^-24 |g| each; the float64 sums add
            # at most n 2^-53 of the magnitudes, under 2^-40 here). Hence
            # |g' - g| <= sum_i w_i [(2^-8 (1 + 2^-7) + 2^-23) |bf16(d_i)| + 2^-24 (|p| +
            # |bf16(d_i)|)] + 2^-24 (|g| + |g'|) + 2^-40 sum_i w_i (|p| + |bf16(d_i)|).
            mag = sum(o * (np.abs(p[name]) + np.abs(d[name])) for o, d in zip(omega, deltas,
                                                                               strict=True))
            bound = sum(o * (U_BF16 * (1 + 2**-7) + 2 * U_FP32) * np.abs(d[name])
                        for o, d in zip(omega, deltas, strict=True)) \
                + U_FP32 * mag + U_FP32 * (np.abs(g[name]) + np.abs(g2[name])) + 2**-40 * mag
            diff = np.abs(g2[name] - g[name])
            assert (diff <= bound).all(), (r, name, float((diff - bound).max()))
            worst = max(worst, float(diff.max()))
    assert worst > 0  # the bf16 rounding does show: the comparison is not vacuous


@pytest.mark.slow  # the quickstart's run, as above
@pytest.mark.parametrize("dtype", ["int8", "nf4"])
def test_quantized_delta_globals_within_the_blockwise_bound(
        tmp_path: Path, quickstart_run: FinishedRun, dtype: str) -> None:
    """The quickstart's trained updates sent as blockwise-quantized deltas (no error
    feedback: one round's error alone) and aggregated by the streaming fedavg: every element
    of each global is within the blockwise bound of the fp32 run's global."""
    run_dir = Path(quickstart_run.status["run_dir"])
    exchange = ExchangeSpec.parse(f"delta/{dtype}/64")
    codec = exchange.codec
    assert codec is not None
    worst = 0.0
    for r in (1, 2, 3):
        parent = run_dir / "rounds" / str(r - 1) / "global"
        reference = run_dir / "rounds" / str(r) / "global"
        sites = sorted(p.name for p in (run_dir / "rounds" / str(r) / "updates").iterdir())
        encoded, absmax = [], []
        for site in sites:
            src = run_dir / "rounds" / str(r) / "updates" / site
            m = read_manifest(src)
            state = {k: torch.from_numpy(v.astype(np.float32))
                     for k, v in _widened(src).items()}
            sent = encode_update(state, parent, exchange)
            # each element's block absmax, from the scales that were sent
            absmax.append({k: np.repeat(sent[k + ".absmax"].double().numpy(), 64)[
                :v.numel()].reshape(v.shape) for k, v in _widened_shapes(src).items()})
            encoded.append(write_checkpoint(
                tmp_path / dtype / f"r{r}" / site, sent, site=site, num_samples=m.num_samples,
                num_tokens=m.num_tokens, round=r, parent=m.parent, run_id=m.run_id,
                config=json.loads((src / "config.json").read_text())))
        out = tmp_path / dtype / f"r{r}" / "global"
        run_strategy("fedavg", encoded, parent, out,
                     decoding=Decoding(parent, delta=True, codec=codec))
        p, g, g2 = _widened(parent), _widened(reference), _widened(out)
        total = float(sum(read_manifest(e).num_samples for e in encoded))
        omega = [read_manifest(e).num_samples / total for e in encoded]
        for name in p:
            # Per site i: d_i = fl32(w_i - p) (|err| <= 2^-24 |d_i|), sent quantized (|err|
            # <= B a_i, a_i the element's block absmax, B = 1/254 for int8, NF4's half gap
            # 0.1385); the coordinator's x_i = fl32(p + q(d_i)) and the fp32 run's global are
            # rounded as in the bf16 test above (2^-24 of the magnitudes, float64 sums 2^-40).
            mag = sum(o * (np.abs(p[name]) + 2 * a[name]) for o, a in zip(omega, absmax,
                                                                           strict=True))
            bound = sum(o * (codec.error_bound() + 2 * U_FP32) * a[name]
                        for o, a in zip(omega, absmax, strict=True)) \
                + U_FP32 * mag + U_FP32 * (np.abs(g[name]) + np.abs(g2[name])) + 2**-40 * mag
            diff = np.abs(g2[name] - g[name])
            assert (diff <= bound).all(), (r, name, float((diff - bound).max()))
            worst = max(worst, float((diff / np.maximum(bound, 1e-30)).max()))
    assert worst > 0.05  # the quantization error shows: the comparison is not vacuous


def _widened_shapes(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (for their shapes)."""
    import safetensors.torch

    return dict(safetensors.torch.load_file(str(path / MODEL_FILE)))
