"""Late updates on the real two-cluster stack (round_deadline.late: adopt): beta's round-1 job
waits behind a blocking job past the deadline; round 1 completes with alpha alone and beta's
job is left in the queue; the coordinator dies right after round 1 is recorded; `xffl resume`
runs round 2, whose beta step adopts the job in flight (no second job at beta) and admits its
update one round late, applied with its staleness weight: the final global is the formula."""

from __future__ import annotations

import json
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
from xffl.jobs.registry import Registry

runner = CliRunner()
DEADLINE = 40  # s: alpha's round (sbatch, torch start-up, 3 steps, copy back) fits well within


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in load_file(directory / "model.safetensors").items()}


def _squeue(stack: Any, ids: str) -> str:
    return str(stack.ssh("beta", f"squeue -h -j {ids} -o '%i|%T'", timeout=20).stdout)


@pytest.mark.slow
def test_late_job_is_left_running_adopted_after_resume_and_applied_with_staleness(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    job = _job(tmp_path, slurm_stack, "late", rounds=2, steps=3, min_sites=1)
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


def _run_and_check(tmp_path: Path, stack: Any, job: Path, blocker: str,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the coordinator (supervisor, StreamFlow, aggregate step) dies right after round 1 is
    # recorded, with beta's job still queued
    monkeypatch.setenv("XFFL_FAILPOINT", "recorded-round-1@group")
    result = runner.invoke(app, ["submit", str(job), "--wait", "--json"])
    monkeypatch.delenv("XFFL_FAILPOINT")
    killed = json.loads(result.stdout)
    assert result.exit_code == 1 and killed["state"] == "failed", result.output
    run_id, run_dir = killed["run_id"], Path(killed["run_dir"])
    status = _status(run_id)
    assert status["rounds_done"] == 1
    first = _sites(status, 1)
    assert first["alpha"]["state"] == "completed"
    late_id = first["beta"]["late_job_id"]
    assert first["beta"]["state"] == "late" and late_id, first["beta"]
    assert set(verify_checkpoint(run_dir / "rounds" / "1" / "global").extra["sites"]) == \
        {"alpha"}
    name = f"xffl-{run_id}-beta-r1"
    assert _squeue(stack, late_id).strip() == f"{late_id}|PENDING"  # not cancelled

    # the blocker ends: beta's round-1 job runs; the resumed run's round 2 adopts it
    stack.ssh("beta", f"scancel {blocker}", timeout=20)
    result = runner.invoke(app, ["resume", run_id])
    assert result.exit_code == 0, result.output
    final = wait_for_run(Registry(), run_id, 300)
    assert final.state == "completed" and final.rounds_done == 2, final.message
    second = _sites(_status(run_id), 2)
    s = 2 ** -0.5  # polynomial staleness, a = 0.5, one round late: (1 + 1) ** -0.5
    assert second["alpha"]["state"] == "completed" and second["alpha"]["staleness"] is None
    beta = second["beta"]
    assert (beta["state"], beta["staleness"]) == ("completed", 1), beta
    assert beta["staleness_weight"] == pytest.approx(s, rel=1e-12)

    shown = runner.invoke(app, ["status", run_id, "--no-live"])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert f"SLURM job {late_id} (round 1) left running at the round deadline" in text
    assert "started in round 1: 1 round(s) late, its change applied with staleness weight " \
        "0.7071" in text

    # one SLURM job at beta for the run, the round-1 one, which completed (never scancelled)
    deadline = time.monotonic() + 30
    while not (records := [r for r in stack.jobcomp_records("beta")
                           if r.get("Name", "").startswith(f"xffl-{run_id}-")]):
        assert time.monotonic() < deadline, "beta's job never reached jobcomp"
        time.sleep(0.5)
    assert [(r["JobId"], r["Name"], r["JobState"]) for r in records] == \
        [(late_id, name, "COMPLETED")]

    # beta's update names the global it started from (round 0's), and lands on round 1's
    rounds = run_dir / "rounds"
    late = verify_checkpoint(rounds / "2" / "updates" / "beta")
    w0_manifest = verify_checkpoint(rounds / "0" / "global")
    assert (late.round, late.parent) == (1, w0_manifest.digest())
    alpha = verify_checkpoint(rounds / "2" / "updates" / "alpha")
    m_a, m_b = alpha.num_samples, late.num_samples
    w0, w1 = _tensors(rounds / "0" / "global"), _tensors(rounds / "1" / "global")
    u_a, u_b = _tensors(rounds / "2" / "updates" / "alpha"), _tensors(
        rounds / "2" / "updates" / "beta")
    got = _tensors(rounds / "2" / "global")
    for name_, w in w1.items():
        # w2 = w1 + (m_a (u_a - w1) + m_b s (u_b - w0)) / (m_a + m_b)   (docs/queues.md)
        want = w + (m_a * (u_a[name_] - w) + m_b * s * (u_b[name_] - w0[name_])) / (m_a + m_b)
        # two fp32 roundings: the rebased update w1 + s (u_b - w0) (weight m_b / (m_a + m_b)
        # <= 1) and the average; each is at most half an ulp, 2^-24 relative, of values
        # bounded by the largest magnitude involved, so |got - want| <= 2^-23 max|.|. A
        # staleness weight of 1, or the change taken against w1 instead of w0, moves the
        # result by (1 - s) m_b/M |u_b - w0| or m_b s/M |w1 - w0|: a training step's size,
        # ~1e-3 here, many orders above the bound.
        bound = 2.0 ** -23 * max(np.abs(want).max(), np.abs(w).max(), 1e-30) * 2
        assert np.abs(got[name_] - want).max() <= bound, name_

    from rocrate.rocrate import ROCrate

    crate_file = tmp_path / "run.crate.zip"
    made = runner.invoke(app, ["provenance", run_id, "-o", str(crate_file)])
    assert made.exit_code == 0, made.output
    crate = ROCrate(str(crate_file))
    terms = "https://xffl.dev/terms#"
    adopted = crate.dereference("#xffl-update-r2-beta")
    assert adopted is not None
    assert adopted[f"{terms}staleness"] == 1
    assert adopted[f"{terms}stalenessWeight"] == pytest.approx(s, rel=1e-12)
    left = crate.dereference("#xffl-update-r1-beta")
    assert left is not None and left[f"{terms}lateSlurmJob"] == late_id
