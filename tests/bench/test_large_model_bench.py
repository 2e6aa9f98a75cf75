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
