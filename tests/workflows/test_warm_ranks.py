"""The tests' warm rank server (tests/workflows/warm_ranks.py), through the real server: a
rank runs as ``python -m`` would, with the server's imports; the client exits as its rank did
(an exit code, a signal's death), passes a signal on, and a dead client takes its rank along."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.workflows.warm_ranks import rank_python

# a rank's module, found in the client's working folder as `python -m probe` finds it there
PROBE = '''
import os, signal, sys, threading
from pathlib import Path

print("torch preloaded:", "torch" in sys.modules, "| first path is the cwd:",
      sys.path[0] == os.getcwd(), "| umask:", oct(os.umask(0)), flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: os._exit(7))  # "wait": ends with 7 at SIGTERM
Path(sys.argv[2]).write_text(str(os.getpid()))
threading.Event().wait()
'''
WAIT_S = 120  # a deadline for events on a loaded machine, never a measured time


def _probe(where: Path, *args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    """The client running ``python -m probe ARGS`` in ``where`` (the probe written there)."""
    (where / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([str(rank_python()), "-m", "probe", *args], cwd=where, env=env,
                            **kwargs)  # type: ignore[call-overload]


def _until(what: str, done: object) -> None:
    """Wait for ``done()`` to be true (polled), failing after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_rank_runs_as_python_m_in_the_warm_server(tmp_path: Path) -> None:
    """The module runs with torch already imported (the server's fork, not a new
    interpreter), finds its module in the working folder as ``python -m`` does, has the
    client's umask (the launcher's owner-only one at a site), writes to the client's stdout,
    and the client exits with the rank's exit code."""
    proc = _probe(tmp_path, "exit", "3", stdout=subprocess.PIPE, umask=0o077)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 3, out
    assert out.decode() == \
        "torch preloaded: True | first path is the cwd: True | umask: 0o77\n"


def test_a_rank_killed_by_a_signal_kills_its_client_alike(tmp_path: Path) -> None:
    """A rank that dies of SIGKILL: the client dies of SIGKILL too (what a launcher sees)."""
    proc = _probe(tmp_path, "killed", stdout=subprocess.DEVNULL)
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_reaches_the_rank_and_a_dead_client_takes_it(tmp_path: Path,
                                                              sig: signal.Signals) -> None:
    """SIGTERM to the client is passed on to its rank (a process of its own), whose handler's
    exit code 7 the client exits with; a client killed (SIGKILL: nothing passed on) takes
    its rank with it."""
    pid_file = tmp_path / "rank.pid"
    proc = _probe(tmp_path, "wait", str(pid_file), stdout=subprocess.DEVNULL)
    try:
        _until("the rank did not write its pid", lambda: proc.poll() is not None or (
            pid_file.exists() and pid_file.read_text().isdigit()))
        assert proc.poll() is None, f"the client ended first ({proc.returncode})"
        rank = int(pid_file.read_text())
        assert rank != proc.pid and _alive(rank)
        proc.send_signal(sig)
        assert proc.wait(timeout=WAIT_S) == (7 if sig == signal.SIGTERM else -signal.SIGKILL)
        _until(f"the rank {rank} outlived its client", lambda: not _alive(rank))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
