"""xffl's SLURM connector against StreamFlow's, on the real two-cluster stack.

The same small cyclic workflow as test_plugin.py (sf_fixtures/), with site b's jobs
submitted to cluster beta through its login node: what the round's time limit does to a
job, and what closing StreamFlow does to a job still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from tests.workflows.extensions.test_plugin import attempts, final_global, run_rounds

SLURM_TIME = "00:10:00"  # the facility's own time limit (minutes in SLURM's records: 10)


def slurm_b(stack: Any, tmp_path: Path, kind: str) -> tuple[dict[str, Any], str]:
    """Site a local, site b a SLURM job at cluster beta (deployment ``kind``): (deps, name)."""
    cluster = stack.clusters["beta"]
    name = f"sft-{secrets.token_hex(3)}"
    workdir = f"{cluster.work_dir}/{name}"
    return {
        "site-a": {"type": "xffl-local", "config": {}},
        "login-b": {"type": "ssh", "workdir": workdir, "config": {
            "nodes": [f"127.0.0.1:{cluster.ssh_port}"], "username": stack.user,
            "sshKey": stack.ssh_key, "checkHostKey": True}},
        "site-b": {"type": kind, "wraps": "login-b", "workdir": workdir, "config": {
            "pollingInterval": 1, "maxConcurrentJobs": 4, "services": {"train": {
                "partition": cluster.partition, "nodes": "1", "ntasks": 1,
                "time": SLURM_TIME, "jobName": name}}}},
    }, name


def _records(stack: Any, name: str) -> list[dict[str, str]]:
    return [r for r in stack.jobcomp_records("beta") if r.get("Name") == name]


@pytest.mark.slow
@pytest.mark.waits
def test_a_slurm_job_past_the_round_deadline_is_scancelled(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    # b's round-2 job sleeps past the limit, which counts from its submission (queue included)
    (ctl / "sleep-b-r2").write_text("120")
    deployments, name = slurm_b(slurm_stack, tmp_path, "xffl-slurm")
    # the round's time limit is a time by design; every other job (a SLURM job's queue,
    # start and a shell script) must end within it, so it is wide: a loaded machine's jobs
    # take seconds, and only round 2 waits it out
    code, out, run_dir = run_rounds(tmp_path, deployments, retries=1, limit=60,
                                    services={"b": "train"})
    assert code == 0, out[-3000:]
    r2 = "a@2(a@1(w0)+b@1(w0))"  # round 2 went on without b
    assert final_global(run_dir) == f"a@3({r2})+b@3({r2})"
    lost = attempts(run_dir, 2, "b")
    assert lost is not None and lost["timed_out"] and lost["attempts"] == 1
    assert "xffl: round timeout" in lost["failures"][0] and "scancelled" in lost["failures"][0]
    states = [r["JobState"] for r in _records(slurm_stack, name)]
    assert states == ["COMPLETED", "CANCELLED", "COMPLETED"], states
    # the facility's own time limit stayed on every job
    assert {r["TimeLimit"] for r in _records(slurm_stack, name)} == {"10"}


@pytest.mark.slow
def test_upstream_slurm_connector_replaces_the_facility_time_limit(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """StreamFlow's SlurmConnector turns the CWL time limit into sbatch --time."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    deployments, name = slurm_b(slurm_stack, tmp_path, "slurm")
    code, out, _ = run_rounds(tmp_path, deployments, limit=30, rounds=1, services={"b": "train"})
    assert code == 0, out[-3000:]
    (record,) = _records(slurm_stack, name)
    assert record["TimeLimit"] == "1"  # 30 s, rounded up by SLURM: not the facility's 10


async def _cancel_while_running(config: dict[str, Any], stack: Any, name: str,
                                outdir: Path) -> list[str]:
    """Start the workflow, cancel it once b's job runs, close StreamFlow: the ids squeue
    still shows pending or running."""
    from xffl.workflows.streamflow_run import execute_workflow, open_context

    context, pristine = open_context(config)
    task = asyncio.create_task(execute_workflow(context, pristine, "rounds", "cancelled",
                                                outdir))
    deadline = time.monotonic() + 120
    while not stack.ssh("beta", f"squeue -h -n {name} -t RUNNING -o %i").stdout.strip():
        assert time.monotonic() < deadline and not task.done(), "b's job never ran"
        await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with contextlib.suppress(Exception):  # upstream: undeploy fails on the inner location
        await context.close()
    # close() awaited any scancel, which returns once the controller marked the job
    # cancelled: no wait needed, and a job that is still pending or running was not
    # cancelled (one cancelled may linger in squeue as completing: not counted)
    return stack.ssh("beta", f"squeue -h -n {name} -t PENDING,RUNNING -o %i").stdout.split()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["slurm", "xffl-slurm"])
def test_closing_streamflow_cancels_the_jobs_in_flight(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Upstream's undeploy passes the inner (ssh) location to scancel and cancels nothing."""
    from xffl.workflows.streamflow_run import load_config

    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    (ctl / "sleep-b-r1").write_text("120")
    deployments, name = slurm_b(slurm_stack, tmp_path, kind)
    run_rounds(tmp_path, deployments, rounds=1, services={"b": "train"}, start=False)
    monkeypatch.chdir(tmp_path)
    config = load_config(tmp_path / "streamflow.yml")
    left = asyncio.run(_cancel_while_running(copy.deepcopy(config), slurm_stack, name,
                                             tmp_path / "out"))
    try:
        if kind == "slurm":
            assert len(left) == 1  # still queued or running at the facility
        else:
            assert left == []
    finally:
        slurm_stack.ssh("beta", f"scancel -n {name}")


async def _late_connector(stack: Any, run_dir: Path, max_rounds: int) -> tuple[Any, Any, Any]:
    """xffl-slurm over beta's login node adopting late jobs of site beta: (connector, its
    location, the ssh connector)."""
    from streamflow.core.deployment import ExecutionLocation
    from streamflow.deployment.connector.ssh import SSHConnector

    from xffl.workflows.extensions.connectors import XfflSlurmConnector

    cluster = stack.clusters["beta"]
    ssh = SSHConnector(deployment_name="login-b", config_dir=str(run_dir),
                       nodes=[f"127.0.0.1:{cluster.ssh_port}"], username=stack.user,
                       sshKey=stack.ssh_key, checkHostKey=True)
    await ssh.deploy(False)
    conn = XfflSlurmConnector(deployment_name="site-b", config_dir=str(run_dir), connector=ssh,
                              service=None, pollingInterval=1, maxConcurrentJobs=4,
                              late={"runDir": str(run_dir), "site": "beta",
                                    "maxRounds": max_rounds})
    inner = ExecutionLocation(name=next(iter(ssh.nodes)), deployment="login-b")
    return conn, ExecutionLocation(name="site-b", deployment="site-b", wraps=inner), ssh


@pytest.mark.slow
def test_adopting_late_jobs_that_end_well_badly_never_or_too_late(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """xffl-slurm's adoption of a job left running at a deadline, against real SLURM: one that
    wrote its update hands it to the adopting step's folder; one scancelled by an operator
    (no update) fails the step and is never adopted again; one still queued at the adopting
    deadline is left running and stays late; one later than maxRounds is scancelled and the
    step submits its own job."""
    from streamflow.core.exception import WorkflowExecutionException

    from xffl.core.layout import RunLayout
    from xffl.workflows.steps.late import LateJob, leave_late, read_adopted, read_late

    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    work = f"{slurm_stack.clusters['beta'].work_dir}/late-{secrets.token_hex(3)}"
    layout = RunLayout(tmp_path)

    def submit(folder: str, script: str, hold: bool = False) -> str:
        out = slurm_stack.ssh("beta", f"mkdir -p {work}/{folder} && cd {work}/{folder} && "
                              f"sbatch --parsable {'--hold ' if hold else ''}--wrap '{script}'",
                              timeout=20)
        assert out.stdout.strip().isdigit(), out
        return str(out.stdout.strip())

    def late(job_id: str, folder: str) -> None:
        leave_late(layout, LateJob(site="beta", job_id=job_id, round=1,
                                   workdir=f"{work}/{folder}"))

    async def scenario() -> None:
        conn, loc, ssh = await _late_connector(slurm_stack, tmp_path, max_rounds=2)
        try:
            # 1. it ends with its update: moved into the adopting step's folder
            late(submit("r1", "sleep 1; mkdir u.tmp && echo hi > u.tmp/x && mv u.tmp update"),
                 "r1")
            slurm_stack.ssh("beta", f"mkdir -p {work}/r2", timeout=20)
            result = await conn.run(loc, ["true", "--round", "2"], workdir=f"{work}/r2",
                                    job_name="adopt-2", timeout=60)
            assert result is not None and result[1] == 0
            assert slurm_stack.ssh("beta", f"cat {work}/r2/update/x").stdout.strip() == "hi"
            assert read_late(layout, "beta") is None and read_adopted(layout, 2, "beta")
            # 2. scancelled by an operator, no update: the step fails, the job is forgotten
            gone = submit("c1", "sleep 300")
            slurm_stack.ssh("beta", f"scancel {gone}", timeout=20)
            late(gone, "c1")
            slurm_stack.ssh("beta", f"mkdir -p {work}/c2", timeout=20)
            with pytest.raises(WorkflowExecutionException, match="left no update"):
                await conn.run(loc, ["true", "--round", "2"], workdir=f"{work}/c2",
                               job_name="adopt-c2", timeout=60)
            assert read_late(layout, "beta") is None
            # 3. still queued when the adopting step's deadline passes: left, still late
            # submitted held (sbatch --hold): a hold after submission races the scheduler,
            # which may start the job on the idle node first
            held = submit("h1", "sleep 300", hold=True)
            late(held, "h1")
            with pytest.raises(WorkflowExecutionException, match=f"SLURM job {held} left "):
                await conn.run(loc, ["true", "--round", "2"], workdir=f"{work}/c2",
                               job_name="adopt-h2", timeout=3)
            record = read_late(layout, "beta")
            assert record is not None and (record.job_id, record.round) == (held, 1)
            assert slurm_stack.ssh("beta", f"squeue -h -j {held} -o %T").stdout.strip() == \
                "PENDING"
            # 4. round 4 is three rounds late (> maxRounds 2): scancelled, the step's own job
            slurm_stack.ssh("beta", f"mkdir -p {work}/n4", timeout=20)
            result = await conn.run(loc, ["echo", "fresh", "--round", "4"],
                                    workdir=f"{work}/n4", job_name="own-4", timeout=60)
            assert result is not None and result[1] == 0 and "fresh" in result[0]
            assert read_late(layout, "beta") is None
            assert read_adopted(layout, 4, "beta") is None
            assert slurm_stack.ssh("beta", f"squeue -h -j {held} -o %i").stdout.strip() == ""
        finally:
            await conn.undeploy(False)
            await ssh.undeploy(False)

    try:
        asyncio.run(scenario())
    finally:
        slurm_stack.ssh("beta", f"scancel -u {slurm_stack.user} -n wrap", timeout=20)
