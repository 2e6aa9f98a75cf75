"""bench/round_overhead/breakdown.py: a round's phases per site from a run's log and job records."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.bench.scripts import load_bench

BASE = time.mktime(time.strptime("2026-11-28 13:20:00", "%Y-%m-%d %H:%M:%S"))
# float64 at ~1.8e9 s has a spacing of 2**-22 s (2.4e-7); every phase is a difference of two
# times each rounded at most twice (mktime + ms / 1000, or BASE + offset): under 1e-6 s off.
# A phase measured between the wrong events is off by 1 ms at least (the times below are
# distinct whole milliseconds), a thousand times that.
TOL = 1e-6


def _line(offset: float, text: str) -> str:
    whole = int(offset)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(BASE + whole))
    return f"{stamp},{round((offset - whole) * 1000):03d} INFO     {text}"


def _run(tmp_path: Path) -> Path:
    """One round at alpha and beta, every event at a known offset from BASE (seconds)."""
    run = tmp_path / "run"
    (run / "job.json").parent.mkdir()
    (run / "job.json").write_text(json.dumps({"rounds": 2, "sites": [{"name": "alpha"},
                                                                     {"name": "beta"}]}))
    jobs = {"alpha": (2.5, 9.25), "beta": (2.75, 10.5)}  # launcher start, end
    for site, (start, end) in jobs.items():
        folder = run / "rounds" / "1" / "updates" / site
        folder.mkdir(parents=True)
        (folder / "slurm_job.json").write_text(json.dumps(
            {"launcher_start": BASE + start, "launcher_end": BASE + end, "job_id": 1}))
    lines = [
        _line(0.5, "DEPLOYING slurm-alpha"),
        _line(1.0, "EXECUTING step /rounds/train_alpha (job /rounds/train_alpha/0.0) on"),
        _line(1.125, "EXECUTING step /rounds/train_beta (job /rounds/train_beta/0.0) on"),
        _line(1.25, "Scheduled job /rounds/train_alpha/0.0 with job id 5"),
        _line(1.5, "Scheduled job /rounds/train_beta/0.0 with job id 6"),
        _line(9.5, "COMPLETED copy from '/w/a/update' on location login-alpha/127.0.0.1:22 to"),
        _line(10.0, "round 1: site alpha completed"),
        _line(11.0, "COMPLETED copy from '/w/b/update' on location login-beta/127.0.0.1:22 to"),
        _line(11.75, "round 1: site beta completed"),
        _line(12.5, "round 1: aggregated 2 updates (alpha, beta) in 0.05 s"),
    ]
    (run / "streamflow.log").write_text("\n".join(lines) + "\n")
    return run


def test_each_phase_is_the_time_between_its_two_events(tmp_path: Path) -> None:
    bd = load_bench("round_overhead", "breakdown.py")
    (row,) = bd.breakdown(_run(tmp_path))  # round 2 has no updates: not listed
    expected = {"alpha": {"out": 0.25, "queue": 1.25, "job": 6.75, "back": 0.25, "admit": 0.5},
                "beta": {"out": 0.5, "queue": 1.25, "job": 7.75, "back": 0.5, "admit": 0.75}}
    for site, phases in expected.items():
        assert row["sites"][site] == pytest.approx(phases, abs=TOL), site
    assert row["agg"] == pytest.approx(0.75, abs=TOL)  # beta's verdict at 11.75 -> 12.5
    assert row["wall"] == pytest.approx(11.5, abs=TOL)  # the first EXECUTING at 1.0 -> 12.5
    assert row["overhead"] == pytest.approx(11.5 - 7.75, abs=TOL)  # minus the slowest job
