"""Tests of the server strategies against numpy references written from their formulas."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from xffl.aggregator import registry, strategies
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.shards import MODEL_FILE
from xffl.aggregator.engine import run_strategy, state_file
from xffl.core.errors import InvalidInput

SHAPES = {"w": (13, 11), "b": (11,), "norm": (7,)}
SAMPLES = {"karolina": 120, "leonardo": 7, "lumi": 33}
Data = dict[str, dict[str, np.ndarray]]

# the defaults, written out from their sources (not read from the code under test): Flower's
# FedAdam, FedYogi, FedAdagrad (flwr.server.strategy) and trimmed mean; FedAvgM with Hsu et
# al.'s momentum 0.9 (Flower's own default 0.0 would make it FedAvg)
DEFAULTS: dict[str, dict[str, float]] = {
    "fedavg": {},
    "fedavgm": {"server_learning_rate": 1.0, "server_momentum": 0.9},
    "fedadam": {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9},
    "fedyogi": {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
    "fedadagrad": {"eta": 0.1, "beta_1": 0.0, "tau": 1e-9},
    "diloco": {"outer_lr": 0.7, "outer_momentum": 0.9},  # Douillard et al. 2023, section 3
    "fedmedian": {},
    "fedtrimmedavg": {"beta": 0.2},
}
STATE = {"fedavgm": ("momentum",), "diloco": ("momentum",), "fedadam": ("m", "v"),
         "fedyogi": ("m", "v"),
         "fedadagrad": ("m", "v")}


def _round_to(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Values as stored in ``dtype``, back in float64."""
    return torch.from_numpy(np.asarray(values, dtype=np.float64)).to(dtype).double().numpy()


def _tensors(
    rng: np.random.Generator, dtype: torch.dtype, scale: float, center: Any = 0.0
) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(
            (
                np.asarray(center[k] if isinstance(center, dict) else center)
                + scale * rng.standard_normal(s)
            ).astype(np.float32)
        ).to(dtype)
        for k, s in SHAPES.items()
    }


def _as_np(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in tensors.items()}


def _global(
    write_ckpt: Callable[..., Path], path: Path, dtype: torch.dtype, seed: int = 0
) -> tuple[Path, dict[str, np.ndarray]]:
    t = _tensors(np.random.default_rng(seed), dtype, 1.0)
    write_ckpt(path, t, kind="global", site=None, round=0)
    return path, _as_np(t)


def _updates(
    make_update: Any,
    dtype: torch.dtype,
    x: dict[str, np.ndarray],
    rnd: int,
    parent: str | None,
    seed: int,
) -> tuple[list[Path], Data]:
    rng = np.random.default_rng(100 + seed)
    dirs, data = [], {}
    for site, n in SAMPLES.items():
        t = _tensors(rng, dtype, 0.1, x)
        data[site] = _as_np(t)
        dirs.append(
            make_update(site, t, num_samples=n, round=rnd, parent=parent, dirname=f"r{rnd}-{site}")
        )
    return dirs, data


def _mean(data: Data, name: str) -> np.ndarray:
    total = sum(SAMPLES.values())
    return sum(SAMPLES[s] * t[name] for s, t in data.items()) / total


def _ref_step(
    name: str, p: dict[str, float], x: np.ndarray, mean: np.ndarray, state: dict[str, np.ndarray]
) -> np.ndarray:
    """Reddi et al. / Flower server update, written out directly."""
    if name == "fedavgm":
        state["momentum"] = p["server_momentum"] * state["momentum"] + (x - mean)
        return x - p["server_learning_rate"] * state["momentum"]
    if name == "diloco":
        return _diloco_step(p["outer_lr"], p["outer_momentum"], x, mean, state)
    delta = mean - x
    m = p["beta_1"] * state["m"] + (1 - p["beta_1"]) * delta
    v = state["v"]
    if name == "fedadam":
        v = p["beta_2"] * v + (1 - p["beta_2"]) * delta**2
    elif name == "fedyogi":
        v = v - (1 - p["beta_2"]) * delta**2 * np.sign(v - delta**2)
    else:
        v = v + delta**2
    state["m"], state["v"] = m, v
    return x + p["eta"] * m / (np.sqrt(v) + p["tau"])


def _diloco_step(lr: float, mu: float, x: np.ndarray, mean: np.ndarray,
                 state: dict[str, np.ndarray]) -> np.ndarray:
    """DiLoCo's outer step (Douillard et al. 2023, Algorithm 1): the outer gradient is the
    previous global minus the average of the sites' parameters, and OuterOpt is SGD with
    Nesterov momentum, as torch.optim.SGD(nesterov=True) documents it: b = mu b + g;
    theta = theta - lr (g + mu b)."""
    g = x - mean
    state["momentum"] = mu * state["momentum"] + g
    return x - lr * (g + mu * state["momentum"])


def _reference(
    name: str, data: Data, x: dict[str, np.ndarray], state: dict[str, Any]
) -> dict[str, np.ndarray]:
    p = DEFAULTS[name]
    out = {}
    for k in SHAPES:
        stack = np.stack([t[k] for t in data.values()])
        if name == "fedavg":
            out[k] = _mean(data, k)
        elif name == "fedmedian":
            out[k] = np.median(stack, axis=0)
        elif name == "fedtrimmedavg":
            cut = int(p["beta"] * len(stack))
            out[k] = np.sort(stack, axis=0)[cut : len(stack) - cut].mean(axis=0)
        else:
            buffers = STATE[name]
            st = {b: state.get((b, k), np.zeros(SHAPES[k])) for b in buffers}
            out[k] = _ref_step(name, p, x[k], _mean(data, k), st)
            for b in buffers:  # stored as fp32 between rounds
                state[(b, k)] = st[b].astype(np.float32).astype(np.float64)
    return out


def _check(out_dir: Path, ref: dict[str, np.ndarray], dtype: torch.dtype) -> dict[str, np.ndarray]:
    got = load_file(str(out_dir / MODEL_FILE))
    for k in SHAPES:
        assert got[k].dtype == dtype and tuple(got[k].shape) == SHAPES[k]
        expected = _round_to(ref[k], dtype)
        np.testing.assert_allclose(got[k].double().numpy(), expected, rtol=1e-6, atol=1e-12)
    return _as_np(got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", registry.names())
def test_one_round_matches_formula(
    name: str, dtype: torch.dtype, make_update: Any, write_ckpt: Any, tmp_path: Path
) -> None:
    g0, x = _global(write_ckpt, tmp_path / "g0", dtype)
    dirs, data = _updates(make_update, dtype, x, 1, None, seed=1)
    m = run_strategy(name, dirs, g0, tmp_path / "g1", run_id="run-1", round=1)
    _check(tmp_path / "g1", _reference(name, data, x, {}), dtype)
    assert m.extra["aggregation"] == name
    assert m.extra["params"] == DEFAULTS[name]
    verify_checkpoint(tmp_path / "g1")


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad", "fedavgm", "diloco"])
def test_three_rounds_reload_state_from_disk(
    name: str, make_update: Any, write_ckpt: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(strategies, "SLICE_ELEMENTS", 40)  # several slices per tensor
    prev, x = _global(write_ckpt, tmp_path / "g0", torch.float32)
    state: dict[Any, np.ndarray] = {}
    for rnd in (1, 2, 3):
        parent = read_manifest(prev).digest()
        dirs, data = _updates(make_update, torch.float32, x, rnd, parent, seed=rnd)
        out = tmp_path / f"g{rnd}"
        m = run_strategy(name, dirs, prev, out, round=rnd)
        x = _check(out, _reference(name, data, x, state), torch.float32)
        files = [state_file(b) for b in STATE[name]]
        assert all(f in m.files for f in files)
        assert m.extra["server_state"]["loaded_from"] == (None if rnd == 1 else str(prev))
        assert m.parent == parent
        verify_checkpoint(out)
        prev = out


def test_state_of_another_strategy_is_not_reused(
    make_update: Any, write_ckpt: Any, tmp_path: Path
) -> None:
    g0, x = _global(write_ckpt, tmp_path / "g0", torch.float32)
    dirs, _ = _updates(make_update, torch.float32, x, 1, None, seed=1)
    run_strategy("fedadam", dirs, g0, tmp_path / "g1")
    dirs2, _ = _updates(make_update, torch.float32, x, 2, None, seed=2)
    m = run_strategy("fedyogi", dirs2, tmp_path / "g1", tmp_path / "g2")
    assert m.extra["server_state"]["loaded_from"] is None


def test_bad_inputs_are_rejected(make_update: Any, write_ckpt: Any, tmp_path: Path) -> None:
    g0, x = _global(write_ckpt, tmp_path / "g0", torch.float32)
    dirs, _ = _updates(make_update, torch.float32, x, 1, None, seed=1)
    with pytest.raises(InvalidInput, match="previous global"):
        run_strategy("fedadam", dirs, None, tmp_path / "out")
    with pytest.raises(InvalidInput, match="no parameter 'lr'"):
        run_strategy("fedadam", dirs, g0, tmp_path / "out", params={"lr": 1.0})
    with pytest.raises(InvalidInput, match="unknown strategy"):
        run_strategy("fedprox", dirs, g0, tmp_path / "out")
    with pytest.raises(InvalidInput, match="beta"):
        run_strategy("fedtrimmedavg", dirs, None, tmp_path / "out", params={"beta": 0.5})
    assert not (tmp_path / "out").exists()


def test_robust_strategies_ignore_one_wild_update(make_update: Any, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    dirs = []
    for i in range(5):
        t = {k: (1.0 + 0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
        if i == 4:
            t = {k: np.full(s, 1e6, dtype=np.float32) for k, s in SHAPES.items()}
        dirs.append(make_update(f"site{i}", t, num_samples=10))
    results = {}
    for name in ("fedavg", "fedmedian", "fedtrimmedavg"):
        run_strategy(name, dirs, None, tmp_path / name)
        results[name] = load_file(str(tmp_path / name / MODEL_FILE))
    for k in SHAPES:
        assert float(results["fedavg"][k].min()) > 1e5  # pulled away by the bad update
        for name in ("fedmedian", "fedtrimmedavg"):
            assert float((results[name][k] - 1.0).abs().max()) < 0.05


def test_progress_is_reported_per_tensor(make_update: Any, write_ckpt: Any, tmp_path: Path) -> None:
    g0, x = _global(write_ckpt, tmp_path / "g0", torch.float32)
    dirs, _ = _updates(make_update, torch.float32, x, 1, None, seed=1)
    seen: list[tuple[int, int]] = []
    run_strategy(
        "fedmedian",
        dirs,
        g0,
        tmp_path / "g1",
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen == [(i, len(SHAPES)) for i in range(1, len(SHAPES) + 1)]


def test_module_entry_point_takes_strategy_and_params(
    make_update: Any, write_ckpt: Any, tmp_path: Path
) -> None:
    from xffl.aggregator.__main__ import main

    g0, x = _global(write_ckpt, tmp_path / "g0", torch.float32)
    parent = read_manifest(g0).digest()
    dirs, _ = _updates(make_update, torch.float32, x, 1, parent, seed=1)
    out = tmp_path / "g1"
    argv = [
        "-o",
        str(out),
        "--round",
        "1",
        "--previous",
        str(g0),
        "--strategy",
        "fedadam",
        "--param",
        "eta=0.5",
        *map(str, dirs),
    ]
    assert main(argv) == 0
    m = verify_checkpoint(out)
    assert m.extra["aggregation"] == "fedadam" and m.extra["params"]["eta"] == 0.5
    assert state_file("m") in m.files and state_file("v") in m.files
    assert main([*argv, "--param", "eta"]) == 2


def test_diloco_three_rounds_against_the_paper_and_resumed_bytes(
    make_update: Any, write_ckpt: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """Three DiLoCo outer steps against the paper's algorithm in float64, never rounded; then
    the same run resumed from round 1's global (its momentum read back from its folder)."""
    monkeypatch.setattr(strategies, "SLICE_ELEMENTS", 40)  # several slices per tensor
    lr, mu = DEFAULTS["diloco"]["outer_lr"], DEFAULTS["diloco"]["outer_momentum"]
    prev, x0 = _global(write_ckpt, tmp_path / "g0", torch.float32)
    x = {k: v.copy() for k, v in x0.items()}
    buf = {k: np.zeros(SHAPES[k]) for k in SHAPES}
    inputs: list[list[Path]] = []
    for rnd in (1, 2, 3):
        parent = read_manifest(prev).digest()
        dirs, data = _updates(make_update, torch.float32, x, rnd, parent, seed=rnd)
        inputs.append(dirs)
        out = tmp_path / "a" / f"g{rnd}"
        m = run_strategy("diloco", dirs, prev, out, round=rnd)
        assert m.extra["server_state"]["loaded_from"] == (None if rnd == 1 else str(prev))
        got = _as_np(load_file(str(out / MODEL_FILE)))
        mom = _as_np(load_file(str(out / state_file("momentum"))))
        for k in SHAPES:
            st = {"momentum": buf[k]}
            x[k] = _diloco_step(lr, mu, x[k], _mean(data, k), st)
            buf[k] = st["momentum"]
            # xffl stores x and the momentum b in fp32 each round (relative error <= u =
            # 2^-24, half an ulp); the paper's float64 run does not. A stored error (ex, eb)
            # moves the next round's by |d x'/d x| = |1 - lr(1 + mu)| = 0.33, |d x'/d b| =
            # lr mu^2 = 0.567, |d b'/d x| = 1, |d b'/d b| = mu = 0.9: at most 1.9 times the
            # larger, plus that round's own rounding. After round r: u M (1 + 1.9 + ...
            # + 1.9^(r-1)), M the largest |x| or |b| so far; float64 rounding (1e-16) is
            # far below. Classical momentum in place of Nesterov's misses by lr mu^2 |b|,
            # orders of magnitude more.
            size = max(np.abs(x[k]).max(), np.abs(buf[k]).max(), np.abs(got[k]).max())
            tol = 2.0**-24 * size * sum(1.9**i for i in range(rnd))
            assert np.abs(got[k] - x[k]).max() <= tol, (rnd, k)
            assert np.abs(mom[k] - buf[k]).max() <= tol, (rnd, k)
        prev = out
    # resumed: round 1's global copied elsewhere (a fresh read of its files), rounds 2-3 again
    import shutil

    shutil.copytree(tmp_path / "a" / "g1", tmp_path / "b" / "g1")
    prev = tmp_path / "b" / "g1"
    for rnd in (2, 3):
        out = tmp_path / "b" / f"g{rnd}"
        run_strategy("diloco", inputs[rnd - 1], prev, out, round=rnd)
        prev = out
    for name in (MODEL_FILE, state_file("momentum")):
        assert (tmp_path / "b" / "g3" / name).read_bytes() == \
            (tmp_path / "a" / "g3" / name).read_bytes()
    assert read_manifest(tmp_path / "b" / "g3").files == read_manifest(tmp_path / "a" / "g3").files


def test_diloco_steps_a_lora_adapter(tmp_path: Path) -> None:
    """DiLoCo on a LoRA job's adapters: the same outer step on every factor, and its
    momentum beside the global adapter."""
    import json

    from safetensors.numpy import load_file as load_np
    from safetensors.numpy import save_file as save_np

    from xffl.aggregator.exchange import Manifest, finalize_manifest
    from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, ADAPTER_FILE
    from xffl.training import lora
    from xffl.training.config import LoraSpec, ModelSpec

    glob = tmp_path / "global"
    lora.init_adapter_global("run-1", ModelSpec(preset="tiny-test"),
                             LoraSpec(r=4, alpha=8, target_modules=["q_proj"]), 0, glob, "base")
    x = load_np(str(glob / ADAPTER_FILE))
    parent = read_manifest(glob)
    ups, sites = [], {"a": (0.01, 3), "b": (-0.03, 1)}
    for site, (shift, n) in sites.items():
        out = tmp_path / site
        out.mkdir()
        save_np({k: v + np.float32(shift) for k, v in x.items()}, str(out / ADAPTER_FILE))
        (out / ADAPTER_CONFIG_FILE).write_text((glob / ADAPTER_CONFIG_FILE).read_text())
        finalize_manifest(out, Manifest(kind="update", run_id="run-1", round=1, site=site,
                                        num_samples=n, parent=parent.digest()))
        ups.append(out)
    m = run_strategy("diloco", ups, glob, tmp_path / "g1", round=1)
    assert state_file("momentum") in m.files and ADAPTER_FILE in m.files
    got = load_np(str(tmp_path / "g1" / ADAPTER_FILE))
    assert json.loads((tmp_path / "g1" / ADAPTER_CONFIG_FILE).read_text())["r"] == 4
    for k, v in x.items():
        w = v.astype(np.float64)
        sent = [(n, (v + np.float32(s)).astype(np.float64)) for s, n in sites.values()]
        mean = sum(n * u for n, u in sent) / 4  # the samples-weighted mean, in float64
        st = {"momentum": np.zeros_like(w)}
        want = _diloco_step(0.7, 0.9, w, mean, st)
        # float64 on both sides from the same fp32 inputs, rounded once to fp32: equal, or
        # one ulp apart where the value sits on a rounding boundary
        assert np.all(np.abs(got[k] - want) <= np.spacing(np.abs(want).astype(np.float32))), k
