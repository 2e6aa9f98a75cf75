"""The simulate benchmark runs end to end on tiny N (its numbers are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "simulate" / "run.py"


@pytest.mark.slow
def test_simulate_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_simulate", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    work = tmp_path / "work"
    code = bench.main(["--sizes", "1,2", "--parallel", "2", "--steps", "1", "--trials", "2",
                       "--repeat", "2", "--work", str(work), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    runs = result["simulate"]
    assert [(r["k"], r["sites"], r["parallel"]) for r in runs] == [(2, 1, 1), (2, 2, 2)]
    for r in runs:
        # each configuration ran --repeat times; the per-site time is the median of its runs
        dirs = sorted(work.glob(f"sim-{r['sites']}-k{r['k']}-*"))
        assert len(dirs) == 2 and r["dir"] == str(dirs[-1])
        summaries = [json.loads((d / "simulate.json").read_text()) for d in dirs]
        per_site = [s["rounds"][0]["seconds"] / r["sites"] for s in summaries]
        # the benchmark divides the same numbers from the same simulate.json files (JSON
        # round-trips floats exactly) and takes the same median: bitwise equal, as are
        # the ratios below
        assert r["per_site_runs"] == per_site
        assert r["per_site_s"] == statistics.median(per_site)
        assert r["peak_rss_mib"] == max(s["peak_rss_bytes"] for s in summaries) / 2**20
        assert all((d / "rounds" / "1" / "global" / "manifest.json").is_file() for d in dirs)
    assert result["rss_ratio"] == {
        "K=2 N=2/N=1": runs[1]["peak_rss_mib"] / runs[0]["peak_rss_mib"]}
    base = result["standalone"]
    assert len(base["trials"]) == 4 and base["per_site_s"] == statistics.median(base["trials"])
    # the standalone sites trained for real: one update each, with their own data
    for rep in range(2):
        updates = sorted((work / f"alone-{rep}" / "standalone" / "updates").iterdir())
        assert [u.name for u in updates] == ["alpha-0", "beta-1"]
        assert all((u / "manifest.json").is_file() for u in updates)
    assert result["per_site_ratio"] == {
        "K=1 N=1": runs[0]["per_site_s"] / base["per_site_s"],
        "K=2 N=2": runs[1]["per_site_s"] / base["per_site_s"]}
    assert "time per site K=1 N=1 / standalone site" in bench.render(result)
