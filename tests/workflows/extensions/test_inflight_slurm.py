"""xffl-slurm's record of a train job in flight, against real SLURM: the connector of a
supervisor that dies (its step cancelled, no undeploy) leaves its job and the record; the
next supervisor's connector adopts the job while SLURM still runs it (no second sbatch) and
submits a new one when it ended; a step that got no job of its own leaves the record."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

import pytest

from xffl.core.layout import Registration, RunLayout
from xffl.jobs.registry.store import Registry
from xffl.workflows.steps.inflight_jobs import (
    EVENT,
    InflightJob,
    read_inflight,
    record_submitted,
)


async def _connector(stack: Any, run_dir: Path) -> tuple[Any, Any, Any]:
    """A supervisor's xffl-slurm over beta's login node for site beta: (connector, its
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
                              inflight={"runDir": str(run_dir), "site": "beta"})
    inner = ExecutionLocation(name=next(iter(ssh.nodes)), deployment="login-b")
    return conn, ExecutionLocation(name="site-b", deployment="site-b", wraps=inner), ssh


async def _until(check: Any, what: str, limit: float = 120.0) -> None:
    """Wait for ``check()`` (an event: a file, SLURM's queue), polling every 0.2 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not check():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.2)


def _step(work: str, rnd: int) -> list[str]:
    """A train step's command for ``rnd``: note the SLURM job id, wait for ``go-r<rnd>``,
    write update/x (the ``--round`` words are a comment to the shell, a round to xffl)."""
    return ["echo", "$SLURM_JOB_ID", ">>", f"{work}/started-r{rnd}", "&&", "while", "[", "!",
            "-e", f"{work}/go-r{rnd}", "];", "do", "sleep", "0.2;", "done", "&&", "mkdir",
            "-p", "update", "&&", "echo", "$SLURM_JOB_ID", ">", "update/x", "#", "--round",
            str(rnd)]


@pytest.mark.slow
def test_a_job_left_by_a_dead_supervisor_is_adopted_while_running_and_replaced_once_ended(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from streamflow.core.exception import WorkflowExecutionException

    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    work = f"{slurm_stack.clusters['beta'].work_dir}/inflight-{secrets.token_hex(3)}"
    here = Path(work)  # the stack's clusters share this machine's filesystem
    layout = RunLayout(tmp_path)
    registry = Registry(tmp_path / "registry.db")
    Registration(run_id="r1", registry=registry.path).write(layout)

    def started(rnd: int) -> list[str]:
        path = here / f"started-r{rnd}"
        return path.read_text().split() if path.exists() else []

    def queued(job_id: str) -> bool:
        out = slurm_stack.ssh("beta", f"squeue -h -j {job_id} -o %i", timeout=20)
        return job_id in out.stdout.split()

    async def dead_supervisor(rnd: int) -> str:
        """A supervisor submits round ``rnd``'s job and dies while it runs: its step is
        cancelled without undeploying (a SIGKILL runs no cleanup). The job's id."""
        slurm_stack.ssh("beta", f"mkdir -p {work}/a{rnd}", timeout=20)
        conn, loc, ssh = await _connector(slurm_stack, tmp_path)
        try:
            step = asyncio.create_task(conn.run(loc, _step(work, rnd), workdir=f"{work}/a{rnd}",
                                                job_name=f"train-{rnd}"))
            await _until(lambda: started(rnd), "the first job never started")
            step.cancel()
            with pytest.raises(asyncio.CancelledError):
                await step
        finally:
            await ssh.undeploy(False)
        job = read_inflight(layout, rnd, "beta")
        assert job is not None and job.workdir == f"{work}/a{rnd}", job  # left for the next
        assert [job.job_id] == started(rnd) and queued(job.job_id)
        return job.job_id

    async def next_supervisor(rnd: int, release: Any) -> tuple[str, int]:
        """The next supervisor's step of the same round, in its own folder; ``release`` runs
        once it has decided."""
        slurm_stack.ssh("beta", f"mkdir -p {work}/b{rnd}", timeout=20)
        conn, loc, ssh = await _connector(slurm_stack, tmp_path)
        try:
            step = asyncio.create_task(conn.run(loc, _step(work, rnd), workdir=f"{work}/b{rnd}",
                                                job_name=f"train-{rnd}"))
            await _until(lambda: [k for _, k, _ in registry.events("r1")].count(EVENT) == rnd,
                         "the step never said what it did with the record")
            release()
            result = await step
        finally:
            await ssh.undeploy(False)
        assert result is not None
        assert read_inflight(layout, rnd, "beta") is None  # the step had the job's outcome
        return result[0], result[1]

    async def scenario() -> None:
        # 1. still running: adopted; its update moves into the new step's folder
        first = await dead_supervisor(1)
        _, code = await next_supervisor(1, lambda: (here / "go-r1").touch())
        assert code == 0
        assert started(1) == [first]  # one sbatch for round 1: the dead supervisor's
        assert (here / "b1" / "update" / "x").read_text().split() == [first]
        # 2. ended (scancelled while no supervisor waited): a new job is submitted
        gone = await dead_supervisor(2)
        slurm_stack.ssh("beta", f"scancel {gone}", timeout=20)
        await _until(lambda: not queued(gone), "the scancelled job stayed queued")
        _, code = await next_supervisor(2, lambda: (here / "go-r2").touch())
        assert code == 0
        again = started(2)
        assert len(again) == 2 and again[0] == gone and again[1] != gone, again
        assert (here / "b2" / "update" / "x").read_text().split() == [again[1]]
        # 3. a step that gets no job of its own (its sbatch refused) leaves an earlier
        # supervisor's record for the next attempt (its controller may have been away)
        left = InflightJob(site="beta", round=3, job_id=gone, workdir=f"{work}/a2")
        record_submitted(layout, left)
        conn, loc, ssh = await _connector(slurm_stack, tmp_path)
        try:
            with pytest.raises(WorkflowExecutionException, match="refused to submit"):
                await conn.run(loc, _step(work, 3), workdir=f"{work}/b$3", job_name="train-3")
        finally:
            await ssh.undeploy(False)
        assert read_inflight(layout, 3, "beta") == left

    asyncio.run(scenario())
    said = [m for _, k, m in registry.events("r1") if k == EVENT]
    assert len(said) == 3, said
    assert said[0].startswith("round 1: beta: SLURM job ") and "adopted, no second job" in said[0]
    assert said[1].startswith("round 2: beta: SLURM job ") and "a new job is submitted" in said[1]
