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


def _reap(by_name: dict[str, float]) -> tuple[int, int] | None:
    """Reap one exited child, adding its CPU seconds (its reaped descendants' included) under
    its command name; (its pid, its exit code), or None when none has exited (raises
    ChildProcessError when no child is left)."""
    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    try:
        with open(f"/proc/{info.si_pid}/comm") as f:
            name = f.read().strip()
    except OSError:
        name = "?"
    _, status, used = os.wait4(info.si_pid, 0)
    by_name[name] = by_name.get(name, 0.0) + used.ru_utime + used.ru_stime
    return info.si_pid, os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    """Run pytest with ``argv`` (or the command after ``--``), reap all it left, print the cost
    in all and by the command name of each process reaped here (``python`` is the test run with
    what it waited for; adopted daemons, ``slurmstepd`` (a SLURM job) and the like apart)."""
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.monotonic()
    command = argv[1:] if argv[:1] == ["--"] else [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *argv]
    main_proc = subprocess.Popen(command)  # reaped by _reap, not by Popen
    by_name: dict[str, float] = {}
    rc: int | None = None
    wall = 0.0
    limit = float("inf")
    while time.monotonic() < limit:  # stack daemons stop at the session's end
        try:
            reaped = _reap(by_name)
        except ChildProcessError:
            break
        if reaped is None:
            time.sleep(0.05)
        elif reaped[0] == main_proc.pid:
            rc, wall = reaped[1], time.monotonic() - start
            limit = time.monotonic() + 20  # a stack left running (XFFL_STACK_KEEP)
    left = _children_left()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    parts = ", ".join(f"{name} {cpu:.1f}" for name, cpu in
                      sorted(by_name.items(), key=lambda kv: -kv[1]) if cpu >= 0.05)
    print(f"test_cost: wall {wall:.1f} s, CPU user {used.ru_utime:.1f} s + sys "
          f"{used.ru_stime:.1f} s = {used.ru_utime + used.ru_stime:.1f} s ({parts})"
          + (f" (still running, not counted: {left})" if left else ""), file=sys.stderr)
    return rc if rc is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
