"""Checkpoints inside a round on the real two-cluster stack: a site's SLURM job scancelled at
step 15 of 40 (after its checkpoint at step 10) is retried by failure.retries, continues at
step 10, and the run's final global is bitwise an uninterrupted run's; SLURM's accounting
shows the cancelled job and its retry."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.stack.profiles import write_profile
from tests.workflows.test_failure_slurm import _job, _sites, _status
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.attempts import read_attempts
from xffl.jobs.registry.store import Registry

runner = CliRunner()


def _submit(where: Path, stack: Any, name: str, setup: list[str]) -> str:
    """A one-round run of 40 steps at beta alone, 2 ranks, a checkpoint every 10 steps; its
    batch script starts with ``setup``. Its run id. (A second site would train the same
    update in both runs, two SLURM jobs of 2 ranks, and prove nothing more: the globals'
    equality is beta's resumed update's.)"""
    where.mkdir()
    job = _job(where, stack, name, rounds=1, steps=40, retries=1, min_sites=1,
               round_timeout=900)
    spec = yaml.safe_load(job.read_text())
    spec["training"]["checkpoint"] = {"every": 10, "keep": 2}
    spec["sites"] = [site for site in spec["sites"] if site["name"] == "beta"]
    spec["sites"][0]["ranks"] = 2
    spec["sites"][0]["profile"] = write_profile(where / "site_profiles",
                                                stack.clusters["beta"], stack, setup=setup)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--json"])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


@pytest.mark.slow
def test_scancelled_site_job_continues_from_its_checkpoint(
        tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """beta's first job pauses after step 15 (a failpoint, once its step-10 checkpoint is
    complete) until it is scancelled as an operator would; the retry runs the job again
    without the failpoint. The reference is the same job uninterrupted, on the same stack
    (the same ranks, threads and launcher, so the same floating-point operations): its final
    global must be the same bytes."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    reference = _submit(tmp_path / "ref", slurm_stack, "ckpt-ref", [])
    first = tmp_path / "beta-first-attempt"
    run_id = _submit(tmp_path / "cut", slurm_stack, "ckpt-cut", [
        f"if [ -e {first} ]; then unset XFFL_FAILPOINT; else touch {first}; "
        "export XFFL_FAILPOINT=round-step-15@pause; fi"])
    name = f"xffl-{run_id}-beta-r1"
    kept = Path(slurm_stack.clusters["beta"].work_dir)
    deadline = time.monotonic() + 300
    while True:  # beta's step-10 checkpoint is complete, the job paused at step 15
        done = list(kept.glob(f"**/kept/{run_id}/checkpoints/*/step-000010/complete"))
        out = slurm_stack.ssh("beta", f"squeue -h -n {name} -o '%i|%T'", timeout=20)
        running = [ln.split("|")[0] for ln in out.stdout.split() if ln.endswith("|RUNNING")]
        if done and running and first.exists():
            break
        assert time.monotonic() < deadline, "beta's job never wrote its checkpoint"
        time.sleep(0.5)
    assert slurm_stack.ssh("beta", f"scancel {running[0]}", timeout=20).returncode == 0
    final = wait_for_run(Registry(), run_id, 600)
    assert final.state == "completed", final.message
    sites = _sites(_status(run_id), 1)
    assert sites["beta"]["state"] == "completed" and sites["beta"]["attempts"] == 2
    layout = RunLayout(Path(final.run_dir))
    update = verify_checkpoint(layout.kept_update(1, "beta"))
    assert update.extra["checkpoints"]["resumed_at"] == 10, update.extra
    assert update.extra["steps"] == 40
    # the cancelled attempt's output reported its step-10 checkpoint: it used no retry
    attempts = read_attempts(layout, 1, "beta")
    assert attempts is not None and (attempts.progressed, attempts.best_step) == (1, 10), \
        attempts
    records = [r for r in slurm_stack.jobcomp_records("beta") if r.get("Name") == name]
    assert [r["JobState"] for r in records] == ["CANCELLED", "COMPLETED"], records

    ref = wait_for_run(Registry(), reference, 600)
    assert ref.state == "completed", ref.message
    ours = verify_checkpoint(layout.global_dir(1))
    theirs = verify_checkpoint(RunLayout(Path(ref.run_dir)).global_dir(1))
    assert ours.files == theirs.files  # the sha256 of every file of the final global
