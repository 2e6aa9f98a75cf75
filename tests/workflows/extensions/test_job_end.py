"""A finished SLURM job's output and exit code in one SSH round trip: the same answers as
upstream's three (on the real stack), from one command that the site's shell runs."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from xffl.schedulers.slurm_login import job_end_command, parse_job_end


def test_the_first_line_is_the_exit_code_the_rest_the_output() -> None:
    assert parse_job_end("3\nline 1\nline 2\n") == (3, "line 1\nline 2")
    assert parse_job_end("0\n") == (0, "")
    # no record (scontrol found no such job): upstream's own call and error decide
    assert parse_job_end("\n") == (None, "")
    assert parse_job_end("") == (None, "")


def test_a_job_id_cannot_reach_the_sites_shell(tmp_path: Path) -> None:
    """The job id comes from the site's sbatch: quoted, it is one word of scontrol's line
    (run here by a real sh, with scontrol a script printing its arguments)."""
    (tmp_path / "scontrol").write_text('#!/bin/sh\nprintf "%s|" "$@"\n')
    (tmp_path / "scontrol").chmod(0o755)
    hostile = "1; touch owned"
    done = subprocess.run(["sh", "-c", job_end_command(hostile)], cwd=tmp_path,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True,
                          text=True, check=True)
    assert not (tmp_path / "owned").exists()
    assert done.stdout == "\n"  # no ExitCode= nor StdOut= in that record: no number, no file


async def _both(stack: Any, tmp_path: Path, job_id: str) -> tuple[Any, Any]:
    """(xffl-slurm's, upstream's) (output, exit code) of one finished job at beta."""
    from streamflow.core.deployment import ExecutionLocation
    from streamflow.deployment.connector.queue_manager import SlurmConnector
    from streamflow.deployment.connector.ssh import SSHConnector

    from xffl.workflows.extensions.connectors import XfflSlurmConnector

    cluster = stack.clusters["beta"]
    ssh = SSHConnector(deployment_name="login-b", config_dir=str(tmp_path),
                       nodes=[f"127.0.0.1:{cluster.ssh_port}"], username=stack.user,
                       sshKey=stack.ssh_key, checkHostKey=True)
    await ssh.deploy(False)
    inner = ExecutionLocation(name=next(iter(ssh.nodes)), deployment="login-b")
    loc = ExecutionLocation(name="site-b", deployment="site-b", wraps=inner)
    answers = []
    try:
        for kind in (XfflSlurmConnector, SlurmConnector):
            conn = kind(deployment_name="site-b", config_dir=str(tmp_path), connector=ssh,
                        service=None, pollingInterval=1, maxConcurrentJobs=4)
            try:
                output = await conn._get_output(job_id, loc)
                answers.append((output, await conn._get_returncode(job_id, loc)))
            except Exception as exc:  # compared below, upstream's error included
                answers.append((type(exc), str(exc)))
    finally:
        await ssh.undeploy(False)
    return answers[0], answers[1]


@pytest.mark.slow
def test_the_same_answers_as_upstream(tmp_path: Path, slurm_stack: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that prints two lines and exits 3, one that exits 0 silently, and an id SLURM
    does not know: xffl-slurm answers exactly what upstream's SlurmConnector does."""
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)  # asyncssh reads ~/.ssh/known_hosts
    work = f"{slurm_stack.clusters['beta'].work_dir}/end-{secrets.token_hex(3)}"
    ids = []
    for script in ("echo first; echo second; exit 3", "true"):
        out = slurm_stack.ssh("beta", f"mkdir -p {work} && cd {work} && sbatch --parsable "
                              f"--wait --wrap '{script}'", timeout=120)
        ids.append(out.stdout.strip())
    assert all(i.isdigit() for i in ids), ids
    for job_id, expected in zip(ids, [("first\nsecond", 3), ("", 0)], strict=True):
        ours, upstream = asyncio.run(_both(slurm_stack, tmp_path, job_id))
        assert ours == upstream == expected
    ours, upstream = asyncio.run(_both(slurm_stack, tmp_path, "999999999"))
    # upstream's own error, raised by upstream's own call: its tail is scontrol's stderr as the
    # SSH session delivered it, which under load once came back empty on one of the two
    # calls ("...job 999999999: " against "...: slurm_load_jobs error: Invalid job id
    # specified"): the class and upstream's sentence are compared, not SLURM's stderr
    prefix = "Error while retrieving return code for job 999999999:"
    assert ours[0] is upstream[0] and str(ours[1]).startswith(prefix) \
        and str(upstream[1]).startswith(prefix), (ours, upstream)
