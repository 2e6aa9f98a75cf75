"""Late updates on the real two-cluster stack (round_deadline.late: adopt): beta's round-1 job
waits behind a blocking job past the deadline. Round 1, a cron tick, completes with alpha
alone and leaves beta's job in the queue; round 2 (a resumed run) adopts the job, which is
still queued at its deadline: beta is late again, and the coordinator dies right after round 2
is recorded. The blocker ends; `xffl resume` runs round 3, whose beta step adopts the same job
(no second job at beta) and admits its update two rounds late, its change applied with its
staleness weight: the final global is the documented formula."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file
from typer.testing import CliRunner

from tests.workflows.test_failure_slurm import _job, _sites, _status
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.store import Registry

runner = CliRunner()
# s: alpha's round (sbatch, torch start-up, 1 to 3 steps sized to the deadline, copy back)
# must end within it (beta's round-1 job, once its blocker ends, is waited for before round
# 3 starts, so that round adopts it whatever the time its job took). A
# deadline is a time by design (nothing else ends a late site's wait), so this one is wide:
# such a round takes ~6 s idle and once took over 30 s in CI with three test workers on 2
# cores (tests/workflows/test_failure_slurm.py); the rounds that wait it out wait idle
# (StreamFlow's squeue polls), so its width costs wall time, hardly CPU
DEADLINE = 60
S2 = 3 ** -0.5  # polynomial staleness, a = 0.5, two rounds late: (1 + 2) ** -0.5


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in load_file(directory / "model.safetensors").items()}


def _squeue(stack: Any, ids: str) -> str:
    return str(stack.ssh("beta", f"squeue -h -j {ids} -o '%i|%T'", timeout=20).stdout).strip()


def _beta_records(stack: Any, run_id: str) -> list[tuple[str, str, str]]:
    return [(r["JobId"], r["Name"], r["JobState"]) for r in stack.jobcomp_records("beta")
            if r.get("Name", "").startswith(f"xffl-{run_id}-")]


@pytest.mark.slow
@pytest.mark.waits
def test_late_job_is_left_running_adopted_across_a_tick_and_a_resume_and_applied_with_staleness(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    job = _job(tmp_path, slurm_stack, "late", rounds=3, steps=3, min_sites=1)
    spec = yaml.safe_load(job.read_text())
    spec["round_deadline"] = {"seconds": DEADLINE, "min_steps": 1, "max_steps": 3, "startup": 5,
                              "late": "adopt",
                              "staleness": {"function": "polynomial", "a": 0.5, "max_rounds": 2}}
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    # a job that takes beta's whole node: beta's round-1 job waits in the queue behind it
    out = slurm_stack.ssh("beta", "sbatch --parsable --exclusive -J blocker --wrap 'sleep 600'",
                          timeout=20)
    blocker = out.stdout.strip()
    assert blocker.isdigit(), out
    try:
        _run_and_check(tmp_path, slurm_stack, job, blocker, monkeypatch)
    finally:
        slurm_stack.ssh("beta", f"scancel {blocker}", timeout=20)


def _late_rounds(stack: Any, job: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, str]:
    """Round 1 as a cron tick, round 2 in a resumed run killed once it is recorded: beta late
    in both with the same job, still queued; (run id, run dir, beta's job id)."""
    result = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["run_id"]
    tick = subprocess.run([str(Path(sys.executable).parent / "xffl"), "round", run_id],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert tick.returncode == 0, tick.stdout + tick.stderr
    first = _sites(_status(run_id), 1)
    late_id = first["beta"]["late_job_id"]
    assert first["alpha"]["state"] == "completed"
    assert first["beta"]["state"] == "late" and late_id, first["beta"]
    assert _squeue(stack, late_id) == f"{late_id}|PENDING"  # the tick ended, the job stays

    # the coordinator (supervisor, StreamFlow, aggregate step) dies right after round 2 is
    # recorded, with beta's job still queued
    monkeypatch.setenv("XFFL_FAILPOINT", "recorded-round-2@group")
    assert runner.invoke(app, ["resume", run_id]).exit_code == 0
    killed = wait_for_run(Registry(), run_id, 300)
    monkeypatch.delenv("XFFL_FAILPOINT")
    assert killed.state == "failed" and killed.rounds_done == 2, killed.message
    second = _sites(_status(run_id), 2)
    assert second["alpha"]["state"] == "completed"
    assert (second["beta"]["state"], second["beta"]["late_job_id"]) == ("late", late_id)
    assert _squeue(stack, late_id) == f"{late_id}|PENDING"  # adopted, waited for, left again
    run_dir = Path(killed.run_dir)
    for rnd in (1, 2):
        glob = verify_checkpoint(run_dir / "rounds" / str(rnd) / "global")
        assert set(glob.extra["sites"]) == {"alpha"}
    assert _beta_records(stack, run_id) == []  # no job of the run ended at beta yet
    return run_id, run_dir, late_id


def _run_and_check(tmp_path: Path, stack: Any, job: Path, blocker: str,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, run_dir, late_id = _late_rounds(stack, job, monkeypatch)

    # the blocker ends: beta's round-1 job runs, and is waited for here (an event, not a
    # time: on a loaded machine its torch start-up alone may take most of a round), so that
    # the resumed run's round 3 adopts a job that ended with its update
    stack.ssh("beta", f"scancel {blocker}", timeout=20)
    deadline = time.monotonic() + 300  # slurmctld writes jobcomp once the job is over
    while not (records := _beta_records(stack, run_id)):
        assert time.monotonic() < deadline, "beta's job never reached jobcomp"
        time.sleep(0.5)
    result = runner.invoke(app, ["resume", run_id])
    assert result.exit_code == 0, result.output
    final = wait_for_run(Registry(), run_id, 300)
    assert final.state == "completed" and final.rounds_done == 3, final.message
    third = _sites(_status(run_id), 3)
    assert third["alpha"]["state"] == "completed" and third["alpha"]["staleness"] is None
    beta = third["beta"]
    assert (beta["state"], beta["staleness"]) == ("completed", 2), beta
    assert beta["staleness_weight"] == pytest.approx(S2, rel=1e-12)
    shown = runner.invoke(app, ["status", run_id, "--no-live"])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert f"SLURM job {late_id} (round 1) left running at the round deadline" in text
    assert "started in round 1: 2 round(s) late, its change applied with staleness weight " \
        "0.5774" in text

    # one SLURM job at beta for the run, the round-1 one, which completed (never scancelled)
    assert records == [(late_id, f"xffl-{run_id}-beta-r1", "COMPLETED")]
    assert _beta_records(stack, run_id) == records  # round 3 submitted no job of its own

    # beta's update names the global it started from (round 0's), and lands on round 2's
    rounds = run_dir / "rounds"
    late = verify_checkpoint(rounds / "3" / "updates" / "beta")
    assert (late.round, late.parent) == (1, verify_checkpoint(rounds / "0" / "global").digest())
    alpha = verify_checkpoint(rounds / "3" / "updates" / "alpha")
    m_a, m_b = alpha.num_samples, late.num_samples
    w0, w2 = _tensors(rounds / "0" / "global"), _tensors(rounds / "2" / "global")
    u_a, u_b = _tensors(rounds / "3" / "updates" / "alpha"), _tensors(
        rounds / "3" / "updates" / "beta")
    got = _tensors(rounds / "3" / "global")
    for name, w in w2.items():
        # w3 = w2 + (m_a (u_a - w2) + m_b s(2) (u_b - w0)) / (m_a + m_b)   (docs/queues.md)
        want = w + (m_a * (u_a[name] - w) + m_b * S2 * (u_b[name] - w0[name])) / (m_a + m_b)
        # two fp32 roundings: the rebased update w2 + s (u_b - w0) (weight m_b / (m_a + m_b)
        # <= 1) and the average; each is at most half an ulp, 2^-24 relative, of values
        # bounded by the largest magnitude involved: |got - want| <= 2 x 2^-24 x max|.| =
        # 2^-23 max|.|. A staleness weight of 1, or the change taken against w2 instead of
        # w0, moves the result by (1 - s) m_b/M |u_b - w0| or m_b s/M |w2 - w0|: training
        # steps' size, ~1e-3 here, orders above the bound.
        bound = 2.0 ** -23 * max(np.abs(want).max(), np.abs(w).max(), 1e-30)
        assert np.abs(got[name] - want).max() <= bound, name

    from rocrate.rocrate import ROCrate

    crate_file = tmp_path / "run.crate.zip"
    made = runner.invoke(app, ["provenance", run_id, "-o", str(crate_file)])
    assert made.exit_code == 0, made.output
    crate = ROCrate(str(crate_file))
    terms = "https://xffl.dev/terms#"
    adopted = crate.dereference("#xffl-update-r3-beta")
    assert adopted is not None
    assert adopted[f"{terms}staleness"] == 2
    assert adopted[f"{terms}stalenessWeight"] == pytest.approx(S2, rel=1e-12)
    for rnd in (1, 2):
        left = crate.dereference(f"#xffl-update-r{rnd}-beta")
        assert left is not None and left[f"{terms}lateSlurmJob"] == late_id
