"""Checkpoints inside a round on the real two-cluster stack, against one uninterrupted run of
the same job at beta alone (a module fixture): a site's SLURM job scancelled at step 6 of 12
(after its checkpoint at step 4) is retried by failure.retries, continues at step 4, and the
run's final global is bitwise the uninterrupted run's, SLURM's accounting showing the
cancelled job and its retry; and a round longer than one job (acceptance 2 of issue 46):
beta's round runs as three chained jobs, each ended through SLURM's own signal path
(``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@M`` delivers before the time limit:
the batch shell's trap, the launcher, the ranks' checkpoint, exit 75), its final global
bitwise the one-job run's; `xffl status --json` lists the jobs with their steps."""

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
STEPS, EVERY = 12, 4  # a checkpoint after steps 4 and 8
PAUSE = 6  # the scancelled job pauses after step 6
STOPS = (4, 8)  # the steps at which the chained round's first two jobs are signalled


def _submit(where: Path, stack: Any, name: str, setup: list[str],
            checkpoint: dict[str, object] | None) -> str:
    """A one-round run of 12 steps at beta alone, 2 ranks, one retry, ``checkpoint`` as its
    training.checkpoint; its batch script starts with ``setup``. Its run id. (A second site
    would train the same update in every run and prove nothing more: the globals' equality
    is beta's update's.)"""
    where.mkdir()
    job = _job(where, stack, name, rounds=1, steps=STEPS, retries=1, min_sites=1,
               round_timeout=900)
    spec = yaml.safe_load(job.read_text())
    if checkpoint is not None:
        spec["training"]["checkpoint"] = checkpoint
    spec["sites"] = [site for site in spec["sites"] if site["name"] == "beta"]
    spec["sites"][0]["ranks"] = 2
    spec["sites"][0]["profile"] = write_profile(where / "site_profiles",
                                                stack.clusters["beta"], stack, setup=setup)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--json"])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


@pytest.fixture(scope="module")
def reference(slurm_stack: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The same job uninterrupted, without checkpoints, on the same stack (the same ranks,
    threads and launcher, so the same floating-point operations: checkpoints and a chain's
    stops change none of them), submitted, not waited for: its data directory (a module
    fixture outlives a test's own) and run id."""
    where = tmp_path_factory.mktemp("ref")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", slurm_stack.ssh_home)
        patch.setenv("XFFL_HOME", str(where / "xffl-home"))
        patch.setenv("XDG_CONFIG_HOME", str(where / "config"))
        return where / "xffl-home", _submit(where / "run", slurm_stack, "ckpt-ref", [], None)


def _same_global(reference: tuple[Path, str], layout: RunLayout) -> None:
    """The run's final global is the reference's (the sha256 of every file)."""
    home, run_id = reference
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XFFL_HOME", str(home))
        ref = wait_for_run(Registry(), run_id, 600)
    assert ref.state == "completed", ref.message
    ours = verify_checkpoint(layout.global_dir(1))
    theirs = verify_checkpoint(RunLayout(Path(ref.run_dir)).global_dir(1))
    assert ours.files == theirs.files


def _running(stack: Any, name: str, skip: list[str]) -> list[str]:
    """The ids of the RUNNING SLURM jobs named ``name`` at beta, but those in ``skip``."""
    out = stack.ssh("beta", f"squeue -h -n {name} -o '%i|%T'", timeout=20)
    return [ln.split("|")[0] for ln in out.stdout.split()
            if ln.endswith("|RUNNING") and ln.split("|")[0] not in skip]


@pytest.mark.slow
def test_scancelled_site_job_continues_from_its_checkpoint(
        tmp_path: Path, slurm_stack: Any, reference: tuple[Path, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """beta's first job pauses after step 6 (a failpoint, once its step-4 checkpoint is
    complete) until it is scancelled as an operator would; the retry runs the job again
    without the failpoint. Its final global must be the reference's bytes."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    first = tmp_path / "beta-first-attempt"
    run_id = _submit(tmp_path / "cut", slurm_stack, "ckpt-cut", [
        f"if [ -e {first} ]; then unset XFFL_FAILPOINT; else touch {first}; "
        f"export XFFL_FAILPOINT=round-step-{PAUSE}@pause; fi"], {"every": EVERY, "keep": 2})
    name = f"xffl-{run_id}-beta-r1"
    kept = Path(slurm_stack.clusters["beta"].work_dir)
    deadline = time.monotonic() + 300
    while True:  # beta's step-4 checkpoint is complete, the job paused at step 6
        done = list(kept.glob(f"**/kept/{run_id}/checkpoints/*/step-{EVERY:06d}/complete"))
        running = _running(slurm_stack, name, [])
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
    assert update.extra["checkpoints"]["resumed_at"] == EVERY, update.extra
    assert update.extra["steps"] == STEPS
    # the cancelled attempt's output reported its step-4 checkpoint: it used no retry
    attempts = read_attempts(layout, 1, "beta")
    assert attempts is not None and (attempts.progressed, attempts.best_step) == (1, EVERY), \
        attempts
    records = [r for r in slurm_stack.jobcomp_records("beta") if r.get("Name") == name]
    assert [r["JobState"] for r in records] == ["CANCELLED", "COMPLETED"], records
    _same_global(reference, layout)


@pytest.mark.slow
def test_a_round_runs_as_three_chained_jobs_bitwise(
        tmp_path: Path, slurm_stack: Any, reference: tuple[Path, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """beta's jobs 1 and 2 hold after steps 4 and 8 (the ``chain-wait-K`` failpoint, so
    the signal lands at a known step); the test signals each job's batch shell as SLURM does
    at ``--signal`` time once the step's checkpoint is complete; job 3 ends the round. Its
    final global must be the reference's (one job) bytes."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    marks = [tmp_path / f"beta-job-{i}" for i in (1, 2)]
    run_id = _submit(tmp_path / "chain", slurm_stack, "chain-cut", [
        f"if [ -e {marks[1]} ]; then unset XFFL_FAILPOINT; elif [ -e {marks[0]} ]; then "
        f"touch {marks[1]}; export XFFL_FAILPOINT=chain-wait-{STOPS[1]}; else "
        f"touch {marks[0]}; export XFFL_FAILPOINT=chain-wait-{STOPS[0]}; fi"],
        {"every": EVERY, "keep": 2, "chain": True})
    name = f"xffl-{run_id}-beta-r1"
    kept = Path(slurm_stack.clusters["beta"].work_dir)
    signalled: list[str] = []
    for step, mark in zip(STOPS, marks, strict=True):
        deadline = time.monotonic() + 300
        while True:  # the job holds after the step, its checkpoint complete
            done = list(kept.glob(f"**/kept/{run_id}/checkpoints/*/step-{step:06d}/complete"))
            running = _running(slurm_stack, name, signalled)
            if done and running and mark.exists():
                break
            assert time.monotonic() < deadline, f"beta's job never reached step {step}"
            time.sleep(0.5)
        signalled.append(running[0])
        cancel = slurm_stack.ssh("beta", f"scancel --signal=USR1 --batch {running[0]}",
                                 timeout=20)
        assert cancel.returncode == 0, cancel.stderr
    final = wait_for_run(Registry(), run_id, 600)
    assert final.state == "completed", final.message
    layout = RunLayout(Path(final.run_dir))
    assert "#SBATCH --signal=B:USR1@" in layout.batch_template("beta").read_text()
    update = verify_checkpoint(layout.kept_update(1, "beta"))
    assert update.extra["checkpoints"]["resumed_at"] == STOPS[1], update.extra
    assert update.extra["steps"] == STEPS
    attempts = read_attempts(layout, 1, "beta")
    assert attempts is not None and attempts.continued == 2 and attempts.failures == [], \
        attempts
    records = [r for r in slurm_stack.jobcomp_records("beta") if r.get("Name") == name]
    assert len(records) == 3 and records[-1]["JobState"] == "COMPLETED", records
    status = _status(run_id)
    jobs = [(j["job_id"], j["step_from"], j["step_to"]) for j in status["slurm"]
            if j["site"] == "beta" and j["round"] == 1]
    assert [(a, b) for _, a, b in jobs] == [(0, STOPS[0]), (STOPS[0], STOPS[1]),
                                            (STOPS[1], STEPS)], status["slurm"]
    assert [j for j, _, _ in jobs[:2]] == signalled
    assert [(c["site"], c["jobs"], c["steps_done"], c["done"]) for c in status["chains"]] \
        == [("beta", 3, STEPS, True)]
    _same_global(reference, layout)
