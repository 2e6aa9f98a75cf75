"""A late SLURM job's update on the coordinator: the site is `late` while its job is in flight;
the round that adopts the job admits its update against the global it started from, with its
staleness, and applies its change to the current global: w + sum m_i s_i d_i / sum m_i."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.engine import run_strategy
from xffl.aggregator.exchange import read_manifest
from xffl.core.layout import RunLayout
from xffl.jobs.registry.attempts import SiteAttempts, write_attempts
from xffl.jobs.registry.states import SiteState
from xffl.jobs.spec.deadline import StalenessSpec
from xffl.workflows.steps.admit import admit
from xffl.workflows.steps.aggregate import applied_updates
from xffl.workflows.steps.late import LateJob, leave_late, mark_adopted, read_late

CONFIG = {"hidden_size": 8}
W0 = np.array([1.0, 2.0, -3.0, 0.5], dtype=np.float32)
W1 = np.array([1.5, 1.0, -2.0, 0.25], dtype=np.float32)


def _run(tmp_path: Path) -> RunLayout:
    layout = RunLayout(tmp_path / "run")
    parent = None
    for rnd, w in ((0, W0), (1, W1)):
        write_checkpoint(layout.global_dir(rnd), {"w": torch.from_numpy(w)}, kind="global",
                         site=None, round=rnd, parent=parent, config=CONFIG)
        parent = read_manifest(layout.global_dir(rnd)).digest()
    return layout


def _update(layout: RunLayout, folder: str, site: str, rnd: int, start: int,
            values: np.ndarray, samples: int) -> Path:
    """``site``'s update of a job submitted in round ``rnd``, trained from global ``start``."""
    return write_checkpoint(layout.root / folder, {"w": torch.from_numpy(values)}, site=site,
                            round=rnd, parent=read_manifest(layout.global_dir(start)).digest(),
                            num_samples=samples, config=CONFIG)


def _left(layout: RunLayout) -> LateJob:
    job = LateJob(site="beta", job_id="4242", round=1, workdir="/scratch/beta/job1")
    leave_late(layout, job)
    write_attempts(layout, SiteAttempts(site="beta", round=1, gave_up=True, timed_out=True,
                                        failures=["attempt 1: xffl: round timeout"]))
    return job


def test_a_site_whose_job_was_left_running_is_late_with_its_job_id(tmp_path: Path) -> None:
    layout = _run(tmp_path)
    _left(layout)
    verdict, manifest = admit(layout, "beta", 1, layout.global_dir(0), None)
    assert (verdict.state, verdict.late_job_id, manifest) == (SiteState.LATE, "4242", None)
    assert "SLURM job 4242 (round 1) left running" in verdict.reason
    assert verdict.site_round().late_job_id == "4242"


def test_an_adopted_update_is_checked_against_the_global_it_started_from(
        tmp_path: Path) -> None:
    layout = _run(tmp_path)
    mark_adopted(layout, 2, _left(layout))
    assert read_late(layout, "beta") is None  # adopted: no longer late
    values = np.array([0.0, 3.0, -1.0, 1.0], dtype=np.float32)
    fn = StalenessSpec(function="polynomial", a=0.5, max_rounds=4)
    honest = _update(layout, "beta-late", "beta", 1, 0, values, 8)
    verdict, manifest = admit(layout, "beta", 2, layout.global_dir(1), honest,
                              staleness_fn=fn)
    assert verdict.state == SiteState.COMPLETED and manifest is not None, verdict.reason
    assert verdict.staleness == 1 and verdict.staleness_weight == pytest.approx(2 ** -0.5)
    # attacks: the late job's update claims to be on time (round 2, from round 1's global),
    # or trained from a global other than the one its job was given
    for folder, rnd, start in (("on-time", 2, 1), ("other-parent", 1, 1)):
        forged = _update(layout, folder, "beta", rnd, start, values, 8)
        verdict, manifest = admit(layout, "beta", 2, layout.global_dir(1), forged,
                                  staleness_fn=fn)
        assert (verdict.state, manifest) == (SiteState.REJECTED, None), folder


def test_a_late_change_is_applied_to_the_current_global_with_its_weight(
        tmp_path: Path) -> None:
    """Round 2: alpha on time from w1 (m_a = 4), beta one round late from w0 (m_b = 8, s =
    2^-0.5): w2 = w1 + (m_a (u_a - w1) + m_b s (u_b - w0)) / (m_a + m_b), in float64."""
    layout = _run(tmp_path)
    mark_adopted(layout, 2, _left(layout))
    fn = StalenessSpec(function="polynomial", a=0.5, max_rounds=4)
    u_a = np.array([2.0, 0.0, -2.5, 0.75], dtype=np.float32)
    u_b = np.array([0.0, 3.0, -1.0, 1.0], dtype=np.float32)
    paths = {"alpha": _update(layout, "alpha", "alpha", 2, 1, u_a, 4),
             "beta": _update(layout, "beta-late", "beta", 1, 0, u_b, 8)}
    verdicts = [admit(layout, site, 2, layout.global_dir(1), path, staleness_fn=fn)[0]
                for site, path in paths.items()]
    assert [v.state for v in verdicts] == [SiteState.COMPLETED] * 2
    inputs = applied_updates(layout, 2, layout.global_dir(1), verdicts, paths)
    assert inputs["alpha"] == paths["alpha"] and inputs["beta"] != paths["beta"]
    out = tmp_path / "global2"
    run_strategy("fedavg", [inputs["alpha"], inputs["beta"]], layout.global_dir(1), out,
                 round=2, parent_digest=read_manifest(layout.global_dir(1)).digest())
    s = 2 ** -0.5
    w0, w1 = W0.astype(np.float64), W1.astype(np.float64)
    want = w1 + (4 * (u_a - w1) + 8 * s * (u_b - w0)) / 12
    got = load_file(out / "model.safetensors")["w"].astype(np.float64)
    # two fp32 roundings (the rebased update, the average), each <= 2^-24 relative of values
    # below 4 in magnitude: 2 * 2^-24 * 4 = 2^-21. Without the staleness factor the result
    # moves by 8/12 (1 - s) |u_b - w0| >= 0.2; against w1 instead of w0 by 8/12 s |w1 - w0|.
    assert np.abs(got - want).max() <= 2.0 ** -21
    rebased = read_manifest(inputs["beta"])
    assert (rebased.round, rebased.site, rebased.num_samples) == (2, "beta", 8)
    assert rebased.extra["started_round"] == 1


@pytest.mark.parametrize("job_id", ["12; rm -rf ~", "[red]1[/red]", "", "1 2", "0x10"])
def test_only_a_plain_slurm_job_id_is_recorded_late_or_read_back(tmp_path: Path,
                                                                 job_id: str) -> None:
    """The id is what the facility's sbatch answered; a later round passes it to squeue and
    scancel and status shows it: anything but digits is refused on write and on read."""
    layout = _run(tmp_path)
    with pytest.raises(ValueError, match="is not a SLURM job id"):
        leave_late(layout, LateJob(site="beta", job_id=job_id, round=1, workdir="/w"))
    assert not layout.late_job("beta").exists()
    layout.late_job("beta").parent.mkdir(parents=True, exist_ok=True)
    layout.late_job("beta").write_text(json.dumps(
        {"site": "beta", "job_id": job_id, "round": 1, "workdir": "/w", "left_at": 0.0}))
    with pytest.raises(ValueError, match="is not a SLURM job id"):
        read_late(layout, "beta")
