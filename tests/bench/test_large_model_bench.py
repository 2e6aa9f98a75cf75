"""The large-model benchmark at a small size: real rounds, the formula check, peaks recorded."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench


def _bench() -> ModuleType:
    return load_bench("large_model")


@pytest.mark.slow
def test_small_model_through_two_rounds(tmp_path: Path) -> None:
    bench = _bench()
    result = bench.run(0.04, 2, tmp_path, timeout=300)
    assert result["state"] == "completed" and result["final_matches_formula"] is True
    assert result["worst_error_ulps"] <= 4
    assert len(result["round_s"]) == 2 and result["coordinator_peak_rss_gib"] > 0
    # the check is not vacuous: a global that missed one round's delta fails it
    final = Path(next((tmp_path / "home" / "runs").iterdir())) / "rounds"
    ok, worst = bench.check_final(tmp_path / "w0", final / "1" / "global", 2)
    assert not ok and worst > 100


def test_model_config_sizes() -> None:
    bench = _bench()
    from xffl.training.streamed import expected_tensors

    for gib in (0.04, 4.0):
        config = bench.model_config(gib)
        size = sum(4 * math.prod(s)
                   for s in expected_tensors(config, None).values())
        assert abs(size / 2**30 - gib) / gib < 0.05


@pytest.mark.slow
def test_round0_of_the_example_job_at_small_shapes(tmp_path: Path) -> None:
    """bench/large_model/round0.py on the llama3.1-8b preset shrunk: the example job renders
    seeded and from a checkpoint folder, round 0 holds the checkpoint's values."""
    bench = load_bench("large_model", "round0.py")
    (result,) = bench.run(["llama3.1-8b"], tmp_path, small=True, max_shard_bytes=1 << 20,
                          baseline=False)  # two renders, not three: the suite's time
    assert result["values_match"] is True
    for case in ("seeded", "checkpoint"):
        assert 0 < result[case]["peak_gib"] < 2 and result[case]["s"] > 0
    assert result["parameters"] == sum(
        math.prod(s) for s in bench.expected_tensors(
            bench.build_config(bench.ModelSpec.model_validate(
                bench.model_spec("llama3.1-8b", bench.SMALL))), None).values())
    assert "| llama3.1-8b |" in bench.table([result])
    # every case cleaned up after itself (a 7B case leaves no 27 GB behind)
    assert not any((tmp_path / d).exists() for d in ("plan", "checkpoint", "copy", "cache"))
