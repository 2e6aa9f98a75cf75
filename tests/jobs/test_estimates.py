"""The per-site estimators: a hand-computed EWMA over a recorded run, SLURM's seed, hostile input.

SLURM's own estimate read from a real ``sbatch --test-only``: tests/jobs/test_slurm_estimate.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.states import RoundState, SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import ewma, site_estimates
from xffl.jobs.slurm_estimate import parse_test_only
from xffl.jobs.status import run_status

# three rounds of two sites: (queue wait, start-up, steps, train seconds); "hpc" is late in
# round 2 (failed: no delivery, so that round is no observation of it)
RECORDED = {
    "hpc": [(100.0, 4.0, 5, 10.0), None, (300.0, 8.0, 4, 12.0), (50.0, 2.0, 8, 8.0)],
    "lab": [(None, 1.0, 10, 5.0), (None, 3.0, 10, 10.0), (None, 1.0, 10, 5.0), None],
}


def _recorded_run(tmp_path: Path, seed: float | None) -> tuple[Registry, str]:
    reg = Registry(tmp_path / "registry.db")
    run_dir = tmp_path / "run"
    run = reg.create_run("r1", "r", tmp_path / "job.yaml", run_dir, 4, ["hpc", "lab"])
    for rnd in range(1, 5):
        reg.start_round(run.id, rnd, ["hpc", "lab"])
        sites = []
        for site, rows in RECORDED.items():
            row = rows[rnd - 1]
            if row is None:
                sites.append(SiteRound(site=site, state=SiteState.FAILED, reason="late"))
                continue
            wait, startup, steps, train = row
            sites.append(SiteRound(site=site, state=SiteState.COMPLETED, train_seconds=train,
                                   startup_seconds=startup))
            update = run_dir / "rounds" / str(rnd) / "updates" / site
            update.mkdir(parents=True)
            (update / "manifest.json").write_text(json.dumps(
                {"metrics": {"steps": float(steps), "train_seconds": train}}))
            if wait is not None:
                reg.record_slurm_job(run.id, rnd, site, f"{rnd}0", "COMPLETED", wait, train)
        reg.finish_round(run.id, RoundRecord(round=rnd, state=RoundState.COMPLETED,
                                             sites=sites))
    if seed is not None:
        reg.record_queue_estimate(run.id, "hpc", seed, "sbatch --test-only")
    return reg, run.id


def test_ewma_by_hand() -> None:
    # s0 = seed; s_k = a x_k + (1 - a) s_(k-1); halves and quarters are exact in binary
    assert ewma([100.0, 300.0, 50.0], 0.5, seed=400.0) == 162.5  # 250, 275, 162.5
    assert ewma([100.0, 300.0, 50.0], 0.5) == 125.0  # 100, 200, 125: from the first value
    assert ewma([], 0.5) is None and ewma([], 0.5, seed=7.0) == 7.0
    assert ewma([8.0, 4.0], 0.25) == 7.0  # 8, 0.25 * 4 + 0.75 * 8
    with pytest.raises(ValueError):
        ewma([1.0], 0.0)


@pytest.mark.parametrize(("alpha", "expected"), [
    # seed 64, then 0 and 32: s1 = (1 - a) 64, s2 = 32 a + (1 - a) s1; dyadic, so exact
    (0.25, 44.0),    # 48, 8 + 36
    (0.75, 28.0),    # 16, 24 + 4
    (0.125, 53.0),   # 56, 4 + 49
    (1.0, 32.0),     # the newest value alone
])
def test_ewma_weighs_the_newest_value_by_alpha(alpha: float, expected: float) -> None:
    """``alpha`` is the weight of the newest value (1: it alone), not of the estimate so far;
    and the values are taken oldest first. At alpha 0.5 either reading gives the same."""
    assert ewma([0.0, 32.0], alpha, seed=64.0) == expected
    assert ewma([0.0, 32.0], alpha) == alpha * 32.0  # from the first value, 0
    # a large alpha follows the newest value more closely than a small one
    assert abs(ewma([0.0, 32.0], 0.75, seed=64.0) - 32.0) < \
        abs(ewma([0.0, 32.0], 0.25, seed=64.0) - 32.0)


def test_site_estimates_over_a_recorded_run(tmp_path: Path) -> None:
    reg, run_id = _recorded_run(tmp_path, seed=400.0)
    est = {e.site: e for e in site_estimates(reg, reg.get_run(run_id))}
    hpc, lab = est["hpc"], est["lab"]
    # hpc, delivered in rounds 1, 3, 4 (round 2 failed: no observation):
    # queue 400 -> 250 -> 275 -> 162.5; start-up 4 -> 6 -> 4; s/step 2 -> 2.5 -> 1.75
    assert (hpc.queue_wait_s, hpc.startup_s, hpc.seconds_per_step) == (162.5, 4.0, 1.75)
    assert (hpc.rounds_seen, hpc.slurm_estimate_s) == (3, 400.0)
    # lab has no SLURM: its queue wait is 0; start-up 1 -> 2 -> 1.5; s/step .5 -> .75 -> .625
    assert (lab.queue_wait_s, lab.startup_s, lab.seconds_per_step) == (0.0, 1.5, 0.625)
    assert hpc.expected_seconds(10) == 162.5 + 4.0 + 17.5
    # `xffl status --json` shows them for a run whose job sizes rounds to a deadline
    run = reg.get_run(run_id)
    assert run_status(reg, run).as_json()["estimates"] == []  # a job without round_deadline
    layout = RunLayout(Path(run.run_dir))
    layout.job_json.parent.mkdir(parents=True, exist_ok=True)
    layout.job_json.write_text(json.dumps({"round_deadline": {"seconds": 600}}))
    shown = run_status(reg, run).as_json()["estimates"]
    assert shown[0] == {"site": "hpc", "queue_wait_s": 162.5, "startup_s": 4.0,
                        "seconds_per_step": 1.75, "rounds_seen": 3, "slurm_estimate_s": 400.0}


def test_without_seed_the_first_wait_starts_the_average(tmp_path: Path) -> None:
    reg, run_id = _recorded_run(tmp_path, seed=None)
    hpc = site_estimates(reg, reg.get_run(run_id))[0]
    assert hpc.queue_wait_s == 125.0 and hpc.slurm_estimate_s is None  # 100, 200, 125


def test_a_hostile_manifest_is_no_speed(tmp_path: Path) -> None:
    reg, run_id = _recorded_run(tmp_path, seed=None)
    for steps, seconds in (("nan", 1.0), (-4, 8.0), ("x", 2.0)):
        manifest = tmp_path / "run" / "rounds" / "4" / "updates" / "hpc" / "manifest.json"
        manifest.write_text(json.dumps({"metrics": {"steps": steps, "train_seconds": seconds}}))
        hpc = site_estimates(reg, reg.get_run(run_id))[0]
        assert hpc.seconds_per_step == 2.5  # rounds 1 and 3 only


ANSWER = ("2026-11-26T00:11:04\nsbatch: Job 4 to start at 2026-11-26T00:16:03 using 2 "
          "processors on nodes alpha-n1 in partition debug\n")


def test_parse_test_only() -> None:
    assert parse_test_only(ANSWER) == 299.0
    # a start already past (the clocks' second boundaries) is no wait, not a negative one
    assert parse_test_only(ANSWER.replace("00:11:04", "00:16:09")) == 0.0


@pytest.mark.parametrize("text", [
    "",  # nothing
    ANSWER.replace("2026-11-26T00:11:04", "now"),  # no clock line
    ANSWER.replace("debug\n", "debug; rm -rf ~\n"),  # anything after the answer
    ANSWER.replace("nodes alpha-n1", "nodes ../../etc"),  # a node list that is no node list
    ANSWER.replace("2026-11-26T00:16:03", "2026-13-45T99:16:03"),  # digits, but no time
    ANSWER.replace("2026-11-26T00:16:03", "2031-11-26T00:16:03"),  # five years away
    "2026-11-26T00:11:04\nsbatch: error: Batch job submission failed: Invalid partition",
])
def test_parse_test_only_refuses_what_is_not_slurms_answer(text: str) -> None:
    assert parse_test_only(text) is None
