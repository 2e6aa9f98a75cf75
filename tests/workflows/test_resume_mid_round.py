"""A round picked up in the middle on the real two-cluster stack: the coordinator dies while
beta's round-1 job runs past its first checkpoint. `xffl resume` adopts the job that is still
running (SLURM has one job of beta's round 1); after a cron tick's death and an operator's
scancel, the next tick submits one new job that continues at the checkpoint's step. Both
runs' globals are bitwise an uninterrupted run's. One round (the interruption is in it; the
rounds after a resumed one are the cycle's plain rounds) and one rank a site (what the
coordinator does with a job in flight does not depend on its ranks; a 2-rank job continuing
at its checkpoint under SLURM is test_round_checkpoint_slurm.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.stack.profiles import write_profile
from tests.workflows.test_failure_slurm import _job, _status
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.follow import wait_for_run
from xffl.jobs.registry.store import Registry
from xffl.workflows.steps.inflight_jobs import EVENT

runner = CliRunner()
XFFL = str(Path(sys.executable).parent / "xffl")
STEPS, EVERY, HOLD = 12, 4, 6  # beta's first job is held after step 6, its checkpoint at 4


def _spec(where: Path, stack: Any, name: str, setup: list[str]) -> Path:
    """One round of 12 steps, 1 rank a site, a checkpoint every 4 steps; beta's batch
    script starts with ``setup``."""
    where.mkdir()
    job = _job(where, stack, name, rounds=1, steps=STEPS, retries=1, min_sites=2,
               round_timeout=900)
    spec = yaml.safe_load(job.read_text())
    spec["training"]["checkpoint"] = {"every": EVERY, "keep": 2}
    spec["sites"][1]["profile"] = write_profile(where / "site_profiles",
                                                stack.clusters["beta"], stack, setup=setup)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _held(where: Path) -> tuple[Path, list[str]]:
    """beta's first job of the run holds after step HOLD until ``where/go`` exists; a later
    job of the run trains straight through. (that file, the setup lines)"""
    first, go = where / "beta-first-job", where / "go"
    return go, [f"if [ -e {first} ]; then unset XFFL_FAILPOINT; else touch {first}; "
                f"export XFFL_FAILPOINT=round-step-{HOLD}@until={go}; fi"]


def _submit(job: Path, *options: str) -> str:
    result = runner.invoke(app, ["submit", str(job), "--json", *options])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


def _beta_jobs(stack: Any, run_id: str, rnd: int) -> list[tuple[str, str]]:
    """beta's jobs of round ``rnd`` as SLURM's accounting has them: (id, state)."""
    name = f"xffl-{run_id}-beta-r{rnd}"
    return [(r["JobId"], r["JobState"]) for r in stack.jobcomp_records("beta")
            if r.get("Name") == name]


def _running_past_checkpoint(stack: Any, run_id: str, where: Path) -> str:
    """Wait until beta's round-1 job runs and its step-4 checkpoint is complete: its id."""
    name = f"xffl-{run_id}-beta-r1"
    kept = Path(stack.clusters["beta"].work_dir)
    deadline = time.monotonic() + 600
    while True:
        done = list(kept.glob(f"**/kept/{run_id}/checkpoints/*/step-{EVERY:06d}/complete"))
        out = stack.ssh("beta", f"squeue -h -n {name} -o '%i|%T'", timeout=20)
        running = [ln.split("|")[0] for ln in out.stdout.split() if ln.endswith("|RUNNING")]
        if done and running and (where / "beta-first-job").exists():
            return running[0]
        assert time.monotonic() < deadline, "beta's job never wrote its first checkpoint"
        time.sleep(0.5)


def _kill(pid: int) -> None:
    """SIGKILL the coordinator: the supervisor's process group (it leads its own session),
    StreamFlow and its steps with it; no cleanup runs. Reaped if it is this process's child."""
    os.killpg(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:  # not this process's child: wait for it to be gone
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists():
            assert time.monotonic() < deadline, f"process {pid} outlived SIGKILL"
            time.sleep(0.2)


def _said(run_id: str) -> list[str]:
    """What the run's steps said of beta's jobs in flight (alpha's may be there too)."""
    return [m for _, kind, m in Registry().events(run_id)
            if kind == EVENT and m.startswith("round 1: beta: ")]


def _global(run_dir: str) -> Any:
    """The sha256 of every file of the run's round-1 global."""
    return verify_checkpoint(RunLayout(Path(run_dir)).global_dir(1)).files


@pytest.mark.slow
def test_a_round_in_the_middle_is_adopted_by_resume_and_continued_by_a_cron_tick(
        tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference is the same job uninterrupted on the same stack (the same ranks,
    threads and launcher, so the same floating-point operations): the global of both
    interrupted runs must be the same bytes."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    reference = _submit(_spec(tmp_path / "ref", slurm_stack, "mid-ref", []))
    go_a, setup_a = _held(tmp_path / "adopt")
    adopt = _submit(_spec(tmp_path / "adopt", slurm_stack, "mid-adopt", setup_a))
    go_b, setup_b = _held(tmp_path / "tick")
    tick = _submit(_spec(tmp_path / "tick", slurm_stack, "mid-tick", setup_b), "--no-start")
    with (tmp_path / "tick" / "first-tick.log").open("wb") as log:
        ticking = subprocess.Popen([XFFL, "round", tick], env=dict(os.environ), stdout=log,
                                   stderr=subprocess.STDOUT,
                                   start_new_session=True)  # as cron: a session of its own

    # A: the coordinator dies while beta's job runs; `xffl resume` adopts the job
    job_a = _running_past_checkpoint(slurm_stack, adopt, tmp_path / "adopt")
    pid = Registry().get_run(adopt).runner_pid
    assert pid is not None
    _kill(pid)
    assert runner.invoke(app, ["resume", adopt]).exit_code == 0
    deadline = time.monotonic() + 300
    while not _said(adopt):  # the resumed step has seen the job still running
        assert time.monotonic() < deadline, "the resumed run never reached beta's step"
        time.sleep(0.5)
    go_a.touch()  # only now may the held job go on: it cannot end before it is adopted

    # B: the cron tick dies the same way; beta's job is scancelled while no one waits for
    # it; the next tick submits one new job, which continues at the step-4 checkpoint
    job_b = _running_past_checkpoint(slurm_stack, tick, tmp_path / "tick")
    _kill(ticking.pid)
    assert slurm_stack.ssh("beta", f"scancel {job_b}", timeout=20).returncode == 0
    deadline = time.monotonic() + 120
    while job_b in slurm_stack.ssh("beta", f"squeue -h -j {job_b} -o %i", timeout=20).stdout:
        assert time.monotonic() < deadline, "the scancelled job stayed in the queue"
        time.sleep(0.5)
    ticked = subprocess.run([XFFL, "round", tick, "--json"], env=dict(os.environ),
                            capture_output=True, text=True, timeout=600)
    assert ticked.returncode == 0, ticked.stdout[-2000:] + ticked.stderr[-3000:]
    assert json.loads(ticked.stdout)["rounds_done"] == 1, ticked.stdout
    assert not go_b.exists()

    final_a = wait_for_run(Registry(), adopt, 600)
    assert final_a.state == "completed" and final_a.rounds_done == 1, final_a.message
    assert _beta_jobs(slurm_stack, adopt, 1) == [(job_a, "COMPLETED")]  # one job, no sbatch
    (said_a,) = _said(adopt)
    assert said_a.startswith(f"round 1: beta: SLURM job {job_a} ") and "adopted" in said_a

    final_b = Registry().get_run(tick)
    assert final_b.state == "completed", final_b.message
    said_b = _said(tick)
    assert said_b[0].startswith(f"round 1: beta: SLURM job {job_b} ") \
        and "ended while no supervisor waited for it: a new job is submitted" in said_b[0]
    jobs_b = _beta_jobs(slurm_stack, tick, 1)
    assert [state for _, state in jobs_b] == ["CANCELLED", "COMPLETED"] \
        and jobs_b[0][0] == job_b, jobs_b
    update = verify_checkpoint(RunLayout(Path(final_b.run_dir)).kept_update(1, "beta"))
    assert update.extra["checkpoints"]["resumed_at"] == EVERY, update.extra
    shown = runner.invoke(app, ["logs", tick, "--site", "beta", "--round", "1", "--json"])
    assert shown.exit_code == 0, shown.output
    assert any(f"continuing round 1 at step {EVERY} from checkpoint" in line
               for line in json.loads(shown.stdout)["lines"]), shown.stdout[-3000:]
    assert _status(tick)["state"] == "completed"

    ref = wait_for_run(Registry(), reference, 600)
    assert ref.state == "completed", ref.message
    theirs = _global(ref.run_dir)
    assert _global(final_a.run_dir) == theirs
    assert _global(final_b.run_dir) == theirs
