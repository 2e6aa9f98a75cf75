"""OpenSSH certificates and ssh-agents for tests: keys signed by the stack's user CA.

Everything is real: ``ssh-keygen -s`` signs, ``ssh-agent`` holds keys, and the stack's sshd
trusts the CA (``TrustedUserCAKeys``), so a login with a certificate works or fails exactly
as it would at a facility with two-factor certificates.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.stack.stack import StackInfo


def new_key(folder: Path, name: str = "id_cert") -> Path:
    """A fresh ed25519 key pair ``folder/name`` (not in any authorized_keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / name
    for path in (key, key.with_name(name + ".pub"), key.with_name(name + "-cert.pub")):
        path.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
                   check=True, capture_output=True, timeout=30)
    return key


def sign(stack: StackInfo, key: Path, validity: str = "-5m:+1h",
         principals: str | None = None, cert: Path | None = None) -> Path:
    """Sign ``key``'s public half with the stack's user CA; return the certificate file.

    ``validity`` is ssh-keygen's ``-V`` (``-5m:+1h``, ``20200101:20200102``, ...). The
    certificate is written as ``KEY-cert.pub`` unless ``cert`` names another place.
    """
    pub = key.with_name(key.name + ".pub")
    made = key.with_name(key.name + "-cert.pub")
    subprocess.run(["ssh-keygen", "-q", "-s", stack.user_ca, "-I", f"xffl-test-{key.name}",
                    "-n", principals or stack.user, "-V", validity, str(pub)],
                   check=True, capture_output=True, timeout=30)
    if cert is not None and cert != made:
        cert.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(made, cert)
        return cert
    return made


def bare_home(folder: Path, stack: StackInfo) -> Path:
    """A HOME whose ~/.ssh holds only the stack's known_hosts: no key to fall back on."""
    ssh = folder / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True)
    ssh.chmod(0o700)
    shutil.copyfile(stack.known_hosts, ssh / "known_hosts")
    return folder


@contextmanager
def ssh_agent(folder: Path) -> Iterator[str]:
    """A real ssh-agent on a socket in ``folder``; yields the socket path, kills it after."""
    folder.mkdir(parents=True, exist_ok=True)
    sock = folder / "agent.sock"
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(100):  # bounded: 10 s
            if sock.exists():
                break
            if proc.poll() is not None:
                raise RuntimeError(f"ssh-agent exited with {proc.returncode}")
            subprocess.run(["sleep", "0.1"], check=False)
        else:
            raise RuntimeError("ssh-agent did not create its socket within 10 s")
        yield str(sock)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)


def agent_add(sock: str, key: Path) -> None:
    """``ssh-add KEY`` into the agent at ``sock`` (ssh-add adds KEY-cert.pub too)."""
    subprocess.run(["ssh-add", str(key)], check=True, capture_output=True, timeout=30,
                   env={**os.environ, "SSH_AUTH_SOCK": sock})
