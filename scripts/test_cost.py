"""The CPU-seconds and wall time of a pytest command, every process it started included.

Usage: ``.venv/bin/python scripts/test_cost.py [pytest args...]`` (runs
``python -m pytest -p no:cacheprovider -p no:xdist -q`` with them), or
``scripts/test_cost.py -- COMMAND...`` for any command (``-- bash scripts/test.sh``: the
whole suite, its workers' stacks and SLURM jobs included). This process makes itself
the child subreaper (prctl), so the daemons of a SLURM stack the tests start (slurmctld,
slurmd, sshd, munged), the jobs' slurmstepd and the SSH sessions, which leave their parent,
are reaped here and their CPU time counted with the rest (``RUSAGE_CHILDREN``). Run it with a
stack instance of its own (``XFFL_STACK_INSTANCE``) that is not running yet, so that the
stack starts and stops inside the measurement. On a shared machine CPU-seconds vary far
less than wall time.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _children_left() -> list[int]:
    """The pids of this process's live children (adopted daemons included)."""
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.append(int(entry))
    return found


def main(argv: list[str]) -> int:
    """Run pytest with ``argv`` (or the command after ``--``), reap all it left, print the cost."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    command = argv[1:] if argv[:1] == ["--"] else [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *argv]
    rc = subprocess.call(command)
    wall = time.monotonic() - start
    limit = time.monotonic() + 60  # stack daemons stop at the session's end
    while time.monotonic() < limit:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.2)
    left = _children_left()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"test_cost: wall {wall:.1f} s, CPU user {used.ru_utime:.1f} s + sys "
          f"{used.ru_stime:.1f} s = {used.ru_utime + used.ru_stime:.1f} s"
          + (f" (still running, not counted: {left})" if left else ""), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
