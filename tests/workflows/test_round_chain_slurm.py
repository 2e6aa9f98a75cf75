"""A round longer than one job on the real two-cluster stack (acceptance 2 of issue 46): beta's
60-step round runs as three chained jobs, each ended through SLURM's own signal path
(``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@M`` delivers before the time limit:
the batch shell's trap, the launcher, the ranks' checkpoint, exit 75), and its update, and so
the run's final global, is bitwise a one-job round's; `xffl status --json` lists the jobs
with their steps."""

from __future__ import annotations

import json
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
from xffl.jobs.registry.attempts import read_attempts
from xffl.jobs.registry.store import Registry

runner = CliRunner()
STOPS = (25, 50)  # the steps at which beta's first two jobs are signalled


def _submit(where: Path, stack: Any, name: str, setup: list[str]) -> str:
    """A one-round run of 60 steps, 2 ranks a site, a checkpoint every 5 steps, chained
    rounds, no retries; beta's batch script starts with ``setup``. Its run id."""
    where.mkdir()
    job = _job(where, stack, name, rounds=1, steps=60, retries=0, min_sites=2,
               round_timeout=900)
    spec = yaml.safe_load(job.read_text())
    spec["training"]["checkpoint"] = {"every": 5, "keep": 2, "chain": True}
    for site in spec["sites"]:
        site["ranks"] = 2
    spec["sites"][1]["profile"] = write_profile(where / "site_profiles",
                                                stack.clusters["beta"], stack, setup=setup)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["submit", str(job), "--json"])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


@pytest.mark.slow
def test_a_round_runs_as_three_chained_jobs_bitwise(
        tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """beta's jobs 1 and 2 hold after steps 25 and 50 (the ``chain-wait-K`` failpoint, so
    the signal lands at a known step); the test signals each job's batch shell as SLURM does
    at ``--signal`` time once the step's checkpoint is complete; job 3 ends the round. The
    reference is the same job in one job per site, on the same stack."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    reference = _submit(tmp_path / "ref", slurm_stack, "chain-ref", [])
    marks = [tmp_path / f"beta-job-{i}" for i in (1, 2)]
    run_id = _submit(tmp_path / "chain", slurm_stack, "chain-cut", [
        f"if [ -e {marks[1]} ]; then unset XFFL_FAILPOINT; elif [ -e {marks[0]} ]; then "
        f"touch {marks[1]}; export XFFL_FAILPOINT=chain-wait-{STOPS[1]}; else "
        f"touch {marks[0]}; export XFFL_FAILPOINT=chain-wait-{STOPS[0]}; fi"])
    name = f"xffl-{run_id}-beta-r1"
    kept = Path(slurm_stack.clusters["beta"].work_dir)
    signalled: list[str] = []
    for step, mark in zip(STOPS, marks, strict=True):
        deadline = time.monotonic() + 300
        while True:  # the job holds after the step, its checkpoint complete
            done = list(kept.glob(f"**/kept/{run_id}/checkpoints/*/step-{step:06d}/complete"))
            out = slurm_stack.ssh("beta", f"squeue -h -n {name} -o '%i|%T'", timeout=20)
            running = [ln.split("|")[0] for ln in out.stdout.split()
                       if ln.endswith("|RUNNING") and ln.split("|")[0] not in signalled]
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
    assert update.extra["steps"] == 60
    attempts = read_attempts(layout, 1, "beta")
    assert attempts is not None and attempts.continued == 2 and attempts.failures == [], \
        attempts
    records = [r for r in slurm_stack.jobcomp_records("beta") if r.get("Name") == name]
    assert len(records) == 3 and records[-1]["JobState"] == "COMPLETED", records
    status = _status(run_id)
    jobs = [(j["job_id"], j["step_from"], j["step_to"]) for j in status["slurm"]
            if j["site"] == "beta" and j["round"] == 1]
    assert [(a, b) for _, a, b in jobs] == [(0, 25), (25, 50), (50, 60)], status["slurm"]
    assert [j for j, _, _ in jobs[:2]] == signalled
    assert [(c["site"], c["jobs"], c["steps_done"], c["done"]) for c in status["chains"]] \
        == [("beta", 3, 60, True)]

    ref = wait_for_run(Registry(), reference, 600)
    assert ref.state == "completed", ref.message
    ours = verify_checkpoint(layout.global_dir(1))
    theirs = verify_checkpoint(RunLayout(Path(ref.run_dir)).global_dir(1))
    assert ours.files == theirs.files  # the sha256 of every file of the final global
