"""A second login node of the test stack: another sshd with the stack's keys and settings,
plus lines of the test's own (a login shell that prints noise, a PATH with fake tools)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.stack import stack as stack_mod


@contextmanager
def extra_login(stack: Any, where: Path, extra: Sequence[str]) -> Iterator[int]:
    """Run an sshd on a free 127.0.0.1 port with the stack's configuration (its per-cluster
    ``Match`` blocks left out) and the ``extra`` lines; yield the port, stop it on exit."""
    port = stack_mod._free_port({c.ssh_port for c in stack.clusters.values()})
    stock = Path(stack.sshd_config).read_text().split("\nMatch ", 1)[0].splitlines()
    lines = [line for line in stock if not line.startswith(("Port ", "PidFile "))]
    config = where / "sshd_config"
    config.write_text("\n".join([*lines, f"Port {port}", f"PidFile {where / 'sshd.pid'}",
                                 *extra]) + "\n")
    with open(where / "sshd.log", "wb") as log:
        sshd = subprocess.Popen([stack_mod._bin("sshd"), "-D", "-e", "-f", str(config)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while not stack_mod._ssh_banner(port, 0.5):
            assert sshd.poll() is None and time.monotonic() < deadline, \
                (where / "sshd.log").read_text()
            time.sleep(0.05)
        yield port
    finally:
        sshd.terminate()
        sshd.wait(timeout=15)
