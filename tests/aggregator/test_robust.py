"""Bounds on one site's influence: weight caps, update-norm clipping, and the two together."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.robust import cap_shares, clip_factors
from xffl.aggregator.engine import run_strategy
from xffl.core.errors import InvalidInput


def test_cap_shares_water_fills() -> None:
    # 1000:1:1:2 with a cap of 0.4: the big one at 0.4, the rest share 0.6 as 1:1:2
    capped = cap_shares([1000.0, 1.0, 1.0, 2.0], 0.4)
    total = 1004.0
    assert [w / total for w in capped] == pytest.approx([0.4, 0.15, 0.15, 0.3])
    # redistribution can push another site over: 10:9:1 at cap 0.45 -> 0.45, 0.45, 0.1
    assert [w / 20 for w in cap_shares([10.0, 9.0, 1.0], 0.45)] == pytest.approx(
        [0.45, 0.45, 0.1])
    assert cap_shares([3.0, 1.0], 1.0) == [3.0, 1.0]  # no cap binds
    assert cap_shares([3.0, 1.0, 0.0], 0.2) == [4 / 3] * 3  # no weighting fits: equal shares
    with pytest.raises(InvalidInput, match=r"in \(0, 1\]"):
        cap_shares([1.0], 0.0)


def test_clip_factors() -> None:
    assert clip_factors([0.0, 0.5, 2.0], 1.0) == [1.0, 1.0, 0.5]
    with pytest.raises(InvalidInput, match="positive"):
        clip_factors([1.0], 0.0)


def _norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a))


def test_a_thousandfold_update_moves_the_global_by_at_most_clip_times_share(
        tmp_path: Path, write_ckpt: Callable[..., Path]) -> None:
    """An attacker claims a huge dataset and sends 1000x an honest change.

    The global with the attacker minus the global with the attacker sending no change (same
    reported weights) is the attacker's own contribution: at most clip_norm x its capped
    share. Both globals are rounded once to fp32, so they may differ from that by two fp32
    roundings of the global: 2 x 2^-24 x ||global||.
    """
    rng = np.random.default_rng(7)
    shapes = {"a.weight": (64, 32), "b.weight": (128,), "c.bias": (16,)}
    x = {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}
    g0_dir = write_ckpt(tmp_path / "g0", x, kind="global", site=None, round=0)
    parent = read_manifest(g0_dir).digest()

    def update(site: str, scale: float, samples: int) -> Path:
        change = {k: rng.normal(0, 0.01, s).astype(np.float32) for k, s in shapes.items()}
        return write_ckpt(tmp_path / "u" / f"{site}-{scale}", {
            k: (x[k] + scale * change[k]).astype(np.float32) for k in shapes},
            site=site, num_samples=samples, parent=parent)

    honest = [update("alpha", 1.0, 100), update("beta", 1.0, 120)]
    clip, cap = 0.5, 0.4

    def aggregate(attacker: Path, out: str) -> dict[str, np.ndarray]:
        run_strategy("fedavg", [*honest, attacker], g0_dir, tmp_path / out,
                     weighting="samples", clip_norm=clip, max_weight_share=cap, round=1,
                     parent_digest=parent)
        return load_file(str(tmp_path / out / "model.safetensors"))

    attacked = aggregate(update("mallory", 1000.0, 10**9), "attacked")
    silent = aggregate(update("mallory", 0.0, 10**9), "silent")
    moved = _norm(attacked, silent)
    slack = 2 * 2.0**-24 * math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2))
                                          for v in attacked.values()))
    assert moved <= clip * cap + slack
    assert moved >= clip * cap - slack  # the cap and the clip both bind: the bound is reached
    bounds = read_manifest(tmp_path / "attacked").extra["bounds"]
    assert bounds["clip_norm"] == clip and bounds["max_weight_share"] == cap
    assert bounds["clip_factors"]["alpha"] == 1.0 and bounds["clip_factors"]["mallory"] < 1e-2
    sites = read_manifest(tmp_path / "attacked").extra["sites"]
    assert sites["mallory"]["weight"] == pytest.approx(cap)
    # without the bounds the attacker owns the global
    run_strategy("fedavg", [*honest, update("mallory", 1000.0, 10**9)], g0_dir,
                 tmp_path / "open", weighting="samples", round=1, parent_digest=parent)
    assert _norm(load_file(str(tmp_path / "open" / "model.safetensors")), x) > 100 * clip


def test_robust_strategies_take_no_bounds(tmp_path: Path,
                                          write_ckpt: Callable[..., Path]) -> None:
    u = write_ckpt(tmp_path / "u", {"w": np.zeros(3, np.float32)}, site="a")
    with pytest.raises(InvalidInput, match="averaging strategies only"):
        run_strategy("fedmedian", [u], None, tmp_path / "out", clip_norm=1.0)
