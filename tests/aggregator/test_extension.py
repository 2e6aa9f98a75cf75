"""Adding a strategy is one registered class: the job spec, the CLI and the aggregator see it."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer.main
import typer.testing
from safetensors.numpy import load_file
from typer.testing import CliRunner

from xffl.aggregator import strategy_catalog
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.safetensors_io import Array
from xffl.cli.app import app
from xffl.jobs.spec.schema import AggregationSpec


class FedHalfParams(strategy_catalog.StrategyParams):
    """The fraction of the way to the mean."""

    fraction: float = 0.5


@pytest.fixture
def fedhalf() -> Iterator[type[strategy_catalog.Strategy[FedHalfParams]]]:
    """A test-only strategy, registered the way a real one is, and removed afterwards."""

    @strategy_catalog.register
    class FedHalf(strategy_catalog.Strategy[FedHalfParams]):
        """Move the global a fraction of the way towards the weighted mean."""

        name = "fedhalf-test"
        Params = FedHalfParams
        summary = "a fraction of the way to the mean"

        def step(self, params: FedHalfParams, x: Array, mean: Array,
                 state: MutableMapping[str, Array]) -> Array:
            """``x + fraction * (mean - x)``."""
            result: Array = x + params.fraction * (mean - x)
            return result

    try:
        yield FedHalf
    finally:
        strategy_catalog.STRATEGIES.pop("fedhalf-test")


def test_a_registered_strategy_is_known_everywhere(
        fedhalf: type[strategy_catalog.Strategy[FedHalfParams]], make_update: Any, write_ckpt: Any,
        tmp_path: Path) -> None:
    # the job spec accepts it and its parameter, and refuses a parameter it does not have
    spec = AggregationSpec.model_validate({"strategy": "fedhalf-test",
                                           "params": {"fraction": 0.25}})
    assert strategy_catalog.resolve_params(spec.strategy, spec.params) == FedHalfParams(
        fraction=0.25)
    with pytest.raises(ValueError, match="fedhalf-test has no parameter 'eta'"):
        AggregationSpec.model_validate({"strategy": "fedhalf-test", "params": {"eta": 1}})

    # the command line aggregates with it: x + 0.25 * (weighted mean - x), computed here
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = np.full((2, 3), 4.0, np.float32)
    b = np.full((2, 3), -8.0, np.float32)
    g0 = write_ckpt(tmp_path / "g0", {"w": x}, kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    ua = make_update("alpha", {"w": a}, round=1, parent=parent, num_samples=3)
    ub = make_update("beta", {"w": b}, round=1, parent=parent, num_samples=1)
    out = tmp_path / "g1"
    result = CliRunner().invoke(app, [
        "aggregate", "--strategy", "fedhalf-test", "--param", "fraction=0.25",
        "--previous", str(g0), "-o", str(out), str(ua), str(ub)])
    assert result.exit_code == 0, result.output
    mean = (3 * a + 1 * b) / 4  # 1.0 everywhere: exact in fp32
    # x, mean and 0.25 * (mean - x) are exact in fp32 and float64 (small integers and
    # quarters), so the strategy's result is exact too
    np.testing.assert_array_equal(load_file(str(out / "model.safetensors"))["w"],
                                  x + 0.25 * (mean - x))
    assert read_manifest(out).extra["aggregation"] == "fedhalf-test"

    # a step needs the global it steps from: without it the command refuses (exit 2), not
    # silently publishing the mean
    refused = CliRunner().invoke(app, [
        "aggregate", "--strategy", "fedhalf-test", "-o", str(tmp_path / "g1b"), str(ua), str(ub)])
    assert refused.exit_code == 2 and "needs the previous global" in refused.output
    assert not (tmp_path / "g1b").exists()

    # and the help lists it with the others
    shown = CliRunner().invoke(app, ["aggregate", "--help"], env={"COLUMNS": "200"})
    assert "fedhalf-test" in shown.output


def test_an_unregistered_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="input should be one of 'fedavg'"):
        AggregationSpec.model_validate({"strategy": "fedhalf-test"})


def test_one_command_drawn_twice_lists_the_strategies_registered_then(
        fedhalf: type[strategy_catalog.Strategy[FedHalfParams]],
        capsys: pytest.CaptureFixture[str]) -> None:
    """The ``xffl`` program builds its click command once per process, and so does CliRunner in
    these tests (tests/typer_once.py): each drawing of ``aggregate --help`` fills in the names
    registered at that moment, not those of the first drawing."""
    assert typer.testing._get_command(app) is typer.testing._get_command(app)
    command = typer.main.get_command(app)

    def shown() -> str:
        with pytest.raises(SystemExit):
            command.main(["aggregate", "--help"], prog_name="xffl")
        return capsys.readouterr().out

    assert "fedhalf-test" in shown()
    registered = strategy_catalog.STRATEGIES.pop("fedhalf-test")
    try:
        assert "fedhalf-test" not in (text := shown()) and "fedavg" in text
    finally:
        strategy_catalog.STRATEGIES["fedhalf-test"] = registered
