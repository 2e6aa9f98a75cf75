"""xffl-ssh against StreamFlow's SSH connector behind a login shell that talks before each command.

Facility accounts often have start-up files that print: ``module`` warnings, banners, two
``pyenv rehash`` racing (``rm: cannot remove '.../shims/tmp.X'``, seen in this project's CI on
the stack's own root account). The fixture starts a second sshd of the stack's whose sessions
source such a file before every command (``ForceCommand``; bash run by sshd reads ``~/.bashrc``,
never ``BASH_ENV``); both connectors then probe the node's hardware and run a command through
their persistent shell.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException
from streamflow.deployment.connector.ssh import SSHConnector

from tests.stack.extra_login import extra_login
from xffl.workflows.extensions.ssh import XfflSshConnector

NOISE_ERR = "rm: cannot remove '/home/u/.pyenv/shims/tmp.u3vpOfAwYo': No such file or directory"
NOISE_OUT = "Lmod: 3 modules loaded"


@pytest.fixture
def noisy_login(slurm_stack: Any, tmp_path: Path) -> Iterator[str]:
    """``127.0.0.1:PORT`` of an sshd whose login shell prints a line on stderr and stdout first."""
    rc = tmp_path / "noisy-rc.sh"
    rc.write_text(f"echo \"{NOISE_ERR}\" >&2\necho \"{NOISE_OUT}\"\n")
    with extra_login(slurm_stack, tmp_path,
                     [f'ForceCommand . {rc}; eval "$SSH_ORIGINAL_COMMAND"']) as port:
        yield f"127.0.0.1:{port}"


def _connector(cls: type[SSHConnector], node: str, stack: Any, tmp_path: Path) -> SSHConnector:
    return cls(deployment_name="login-noisy", config_dir=str(tmp_path), nodes=[node],
               username=stack.user, sshKey=stack.ssh_key, checkHostKey=False, retries=1,
               retryDelay=0)


async def _probe_and_echo(conn: SSHConnector, node: str) -> tuple[float, tuple[str, int] | None]:
    """(cores the node reports, what ``echo hello`` gives through the persistent shell)."""
    try:
        locations = await conn.get_available_locations()
        cores = locations[node].hardware.cores
        # a fresh connector: the shell's first command, not the probe's session
        echoed = await conn.run(ExecutionLocation(name=node, deployment="login-noisy"),
                                ["echo", "hello"], capture_output=True)
        return cores, echoed
    finally:
        await conn.undeploy(False)


@pytest.mark.slow
def test_the_login_shell_really_talks(noisy_login: str, slurm_stack: Any) -> None:
    """The fixture does what it claims, seen by OpenSSH's own client."""
    host, port = noisy_login.split(":")
    out = subprocess.run(["ssh", "-p", port, "-i", slurm_stack.ssh_key, "-o", "BatchMode=yes",
                          "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                          f"{slurm_stack.user}@{host}", "echo", "hello"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [NOISE_OUT, "hello"]
    assert NOISE_ERR in out.stderr


@pytest.mark.slow
def test_upstream_reads_the_login_shells_words_as_hardware(noisy_login: str, slurm_stack: Any,
                                                           tmp_path: Path) -> None:
    """StreamFlow's probe fails the deployment; its shell would hand the noise to a command."""
    conn = _connector(SSHConnector, noisy_login, slurm_stack, tmp_path)
    with pytest.raises(WorkflowExecutionException,
                       match=r"Impossible to retrieve available hardware for location "
                             r"login-noisy\. An error message occurred: (rm|Lmod)"):
        asyncio.run(_probe_and_echo(conn, noisy_login))

    async def echo_only() -> tuple[str, int] | None:
        try:
            return await conn.run(ExecutionLocation(name=noisy_login, deployment="login-noisy"),
                                  ["echo", "hello"], capture_output=True)
        finally:
            await conn.undeploy(False)

    conn = _connector(SSHConnector, noisy_login, slurm_stack, tmp_path)
    output, code = asyncio.run(echo_only()) or ("", -1)
    # the login's stdout always comes first; its stderr too unless sshd forwards it later
    assert code == 0 and output != "hello" and output.endswith("hello")
    assert output.startswith(NOISE_OUT) or output.startswith(NOISE_ERR)


@pytest.mark.slow
def test_xffl_ssh_reads_the_probe_and_the_command_only(noisy_login: str, slurm_stack: Any,
                                                       tmp_path: Path) -> None:
    conn = _connector(XfflSshConnector, noisy_login, slurm_stack, tmp_path)
    cores, echoed = asyncio.run(_probe_and_echo(conn, noisy_login))
    # the same machine over loopback: nproc as the login shell's process sees it
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}  # nproc reads them
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True,
                           env=env).stdout
    assert cores == float(nproc)
    assert echoed == ("hello", 0)
