"""The simulate benchmark runs end to end on tiny N (its numbers are reported, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.bench.scripts import load_bench


def _bench() -> ModuleType:
    return load_bench("simulate")


def _rep(n: int, wall: float, round_s: float, rss: float, train: float) -> dict[str, Any]:
    return {"sites": n, "parallel": 2, "wall_s": wall, "round_s": round_s,
            "per_site_s": round_s / n, "peak_rss_mib": rss, "train_s": train, "dir": f"d{wall}"}


def test_repeats_are_summed_up_by_medians_and_the_highest_peak() -> None:
    """Three repeats of one configuration: medians of the times, the max of the peaks."""
    reps = [_rep(4, 9.0, 8.0, 300.0, 0.5), _rep(4, 5.0, 4.0, 250.0, 0.7),
            _rep(4, 7.0, 12.0, 280.0, 0.6)]
    got = _bench()._combine(2, reps)
    assert got == {"k": 2, "sites": 4, "parallel": 2, "wall_s": 7.0, "round_s": 8.0,
                   "per_site_s": 2.0, "per_site_runs": [2.0, 1.0, 3.0], "peak_rss_mib": 300.0,
                   "train_s": 0.6, "dir": "d7.0"}


@pytest.mark.slow
def test_simulate_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    work = tmp_path / "work"
    code = bench.main(["--sizes", "1,2", "--parallel", "2", "--steps", "1", "--trials", "2",
                       "--repeat", "1", "--work", str(work), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    runs = result["simulate"]
    assert [(r["k"], r["sites"], r["parallel"]) for r in runs] == [(2, 1, 1), (2, 2, 2)]
    for r in runs:
        (run_dir,) = sorted(work.glob(f"sim-{r['sites']}-k{r['k']}-*"))
        assert r["dir"] == str(run_dir)
        summary = json.loads((run_dir / "simulate.json").read_text())
        # the benchmark divides the same numbers from the same simulate.json (JSON
        # round-trips floats exactly): bitwise equal, as are the ratios below
        assert r["per_site_runs"] == [summary["rounds"][0]["wall_s"] / r["sites"]]
        assert r["peak_rss_mib"] == summary["peak_rss_bytes"] / 2**20
        assert (run_dir / "rounds" / "1" / "global" / "manifest.json").is_file()
    assert result["rss_ratio"] == {
        "K=2 N=2/N=1": runs[1]["peak_rss_mib"] / runs[0]["peak_rss_mib"]}
    base = result["standalone"]
    assert len(base["trials"]) == 2 and base["per_site_s"] == sum(base["trials"]) / 2
    # the standalone sites trained for real: one update each, with their own data
    updates = sorted((work / "alone-0" / "standalone" / "updates").iterdir())
    assert [u.name for u in updates] == ["alpha-0", "beta-1"]
    assert all((u / "manifest.json").is_file() for u in updates)
    assert result["per_site_ratio"] == {
        "K=1 N=1": runs[0]["per_site_s"] / base["per_site_s"],
        "K=2 N=2": runs[1]["per_site_s"] / base["per_site_s"]}
    assert "time per site K=1 N=1 / standalone site" in bench.render(result)
