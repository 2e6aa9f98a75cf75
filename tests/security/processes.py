"""Processes for the liveness tests: a stand-in supervisor holding a run's round lock."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from xffl.jobs.registry.round_lock import holder

_HOLD = ("import sys, time; from pathlib import Path; from xffl.jobs.registry.round_lock import round_lock\n"
         "with round_lock(Path(sys.argv[1])):\n    time.sleep(120)\n")


def lock_holder(run_dir: Path, session: bool = True) -> subprocess.Popen[bytes]:
    """A process that holds ``run_dir``'s round lock (as a supervisor does) for up to 120 s.

    It leads its own session, as a detached supervisor does. Returns once it holds the lock.
    """
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)],
                            start_new_session=session)
    deadline = time.monotonic() + 30
    while holder(run_dir) != proc.pid:
        assert proc.poll() is None, "the lock holder exited"
        assert time.monotonic() < deadline, "the lock holder did not take the lock in 30 s"
        time.sleep(0.05)
    return proc
