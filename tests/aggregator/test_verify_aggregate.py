"""The one verify-then-aggregate: every caller checks an update the same way, folding and
aggregating at once write the same global, and the FedAvg engine follows the strategy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from xffl.aggregator import strategy_catalog
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.verify import UpdateRejected
from xffl.aggregator.verify_aggregate import (
    Aggregation,
    round_rules,
    verify_and_aggregate,
    verify_update,
)
from xffl.cli.app import app
from xffl.core.errors import InvalidInput

X = np.arange(6, dtype=np.float32).reshape(2, 3)  # the global the round started from
A = np.full((2, 3), 4.0, np.float32)  # alpha's update, 3 samples
B = np.full((2, 3), -8.0, np.float32)  # beta's update, 1 sample


def _round(tmp_path: Path, write_ckpt: Any, make_update: Any,
           beta_config: dict[str, int] | None = None) -> tuple[Path, Path, Path]:
    """The global of round 0 and two updates of round 1 made from it."""
    g0 = write_ckpt(tmp_path / "g0", {"w": X}, kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    ua = make_update("alpha", {"w": A}, round=1, parent=parent, num_samples=3)
    ub = make_update("beta", {"w": B}, round=1, parent=parent, num_samples=1,
                     config=beta_config)
    return g0, ua, ub


def test_xffl_aggregate_rejects_what_the_admit_step_rejects(
        tmp_path: Path, write_ckpt: Any, make_update: Any) -> None:
    """An update whose config is not the global's: the admit step's check (verify_update)
    rejects it, and so does `xffl aggregate --previous`, with the same reason."""
    g0, ua, ub = _round(tmp_path, write_ckpt, make_update, beta_config={"hidden_size": 9})
    rules = round_rules(g0, round=1)
    with pytest.raises(UpdateRejected) as admitted:
        verify_update(rules, ub, "beta")
    assert "config" in admitted.value.reason
    result = CliRunner().invoke(app, ["aggregate", "--previous", str(g0), "--round", "1",
                                      "-o", str(tmp_path / "g1"), "--json", str(ua), str(ub)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [(r["site"], r["reason"]) for r in report["rejected"]] == [
        ("beta", admitted.value.reason)]
    assert [u["site"] for u in report["used"]] == ["alpha"]


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm", "diloco"])
def test_folding_writes_the_global_aggregating_at_once_writes(
        strategy: str, tmp_path: Path, write_ckpt: Any, make_update: Any) -> None:
    """``fold`` (xffl simulate) and at once (xffl aggregate, the round's step) agree bit for
    bit here: the weighted mean (3*4 + 1*(-8)) / 4 = 1 is exact in fp32, so the fold's fp32
    mean is the float64 mean the other path steps from, and both take the same float64 step
    (a uniform mean, -2, or the wrong weights would differ in every element)."""
    g0, ua, ub = _round(tmp_path, write_ckpt, make_update)
    rules = round_rules(g0, round=1)
    how = Aggregation(strategy, "samples")
    at_once = verify_and_aggregate(rules, how, [ua, ub], tmp_path / "once")
    seen: list[str] = []
    folded = verify_and_aggregate(rules, how, iter([ua, ub]), tmp_path / "fold", fold=True,
                                  on_update=lambda d, m: seen.append(str(m.site)))
    assert seen == ["alpha", "beta"] and folded.accepted == [ua, ub]
    assert folded.manifest.files["model.safetensors"] == \
        at_once.manifest.files["model.safetensors"]
    assert folded.manifest.extra["aggregation"] == at_once.manifest.extra["aggregation"]


def test_folding_refuses_what_needs_every_update_and_stops_at_a_bad_one(
        tmp_path: Path, write_ckpt: Any, make_update: Any) -> None:
    g0, ua, ub = _round(tmp_path, write_ckpt, make_update, beta_config={"hidden_size": 9})
    rules = round_rules(g0, round=1)
    with pytest.raises(InvalidInput, match="averaging strategy"):
        verify_and_aggregate(rules, Aggregation("fedmedian"), [ua], tmp_path / "m", fold=True)
    with pytest.raises(UpdateRejected, match="config"):
        verify_and_aggregate(rules, Aggregation(), [ua, ub], tmp_path / "f", fold=True)
    assert not (tmp_path / "f").exists() and not (tmp_path / "m").exists()


@pytest.fixture
def fedmean() -> Iterator[None]:
    """A test-only strategy that publishes the mean under a name of its own."""

    @strategy_catalog.register
    class FedMean(strategy_catalog.Strategy[strategy_catalog.StrategyParams]):
        """The weighted mean, by another name."""

        name = "fedmean-test"

    try:
        yield
    finally:
        strategy_catalog.STRATEGIES.pop("fedmean-test")


def test_the_fedavg_engine_is_chosen_by_what_the_strategy_does(
        fedmean: None, tmp_path: Path, write_ckpt: Any, make_update: Any) -> None:
    """A strategy with no step and no robust rule publishes the mean: the FedAvg engine
    writes it (the same bytes as fedavg, no server state), under the strategy's own name."""
    g0, ua, ub = _round(tmp_path, write_ckpt, make_update)
    rules = round_rules(g0, round=1)
    assert strategy_catalog.get("fedmean-test").mean
    assert [n for n in strategy_catalog.names() if strategy_catalog.get(n).mean] == [
        "fedavg", "fedmean-test"]
    mean = verify_and_aggregate(rules, Aggregation("fedmean-test"), [ua, ub], tmp_path / "m")
    fedavg = verify_and_aggregate(rules, Aggregation(), [ua, ub], tmp_path / "a")
    assert mean.manifest.extra["aggregation"] == "fedmean-test"
    assert "server_state" not in mean.manifest.extra
    assert mean.manifest.files == fedavg.manifest.files


def test_strategy_parameters_are_typed_and_recorded_in_their_order(
        tmp_path: Path, write_ckpt: Any, make_update: Any) -> None:
    p = strategy_catalog.resolve_params("fedadam", {"tau": 1e-3})
    assert isinstance(p, strategy_catalog.get("fedadam").Params)
    assert (p.eta, p.beta_1, p.beta_2, p.tau) == (0.1, 0.9, 0.99, 1e-3)  # type: ignore[attr-defined]
    with pytest.raises(InvalidInput, match=r"diloco outer_lr must be > 0, got 0\.0\.$"):
        strategy_catalog.resolve_params("diloco", {"outer_lr": 0})
    with pytest.raises(InvalidInput, match=r"no parameter 'lr' \(it has: eta, beta_1, tau\)"):
        strategy_catalog.resolve_params("fedadagrad", {"lr": 1})
    g0, ua, ub = _round(tmp_path, write_ckpt, make_update)
    done = verify_and_aggregate(round_rules(g0, round=1),
                                Aggregation("fedadam", params={"tau": 1e-3}), [ua, ub],
                                tmp_path / "g1")
    assert list(done.manifest.extra["params"].items()) == [
        ("eta", 0.1), ("beta_1", 0.9), ("beta_2", 0.99), ("tau", 1e-3)]


def test_the_exchange_says_once_how_updates_are_read(tmp_path: Path, write_ckpt: Any) -> None:
    g0 = write_ckpt(tmp_path / "g0", {"w": X, "step": np.array([3], np.int64)},
                    kind="global", site=None, round=0)
    index = read_manifest(g0).tensors
    plain = ExchangeSpec()
    assert plain.reference(index) is index and plain.decoding(g0) is None
    bf16 = ExchangeSpec.parse("delta/bf16")
    assert [(t.name, t.dtype) for t in bf16.reference(index)] == [("step", "I64"), ("w", "BF16")]
    decoding = bf16.decoding(g0)
    assert decoding is not None and decoding.delta and decoding.codec is None
    nf4 = ExchangeSpec.parse("delta/nf4/64").decoding(g0)
    assert nf4 is not None and nf4.codec is not None and nf4.codec.block_size == 64
