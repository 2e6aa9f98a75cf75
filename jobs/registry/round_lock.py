"""One execution at a time per run: an exclusive lock that the supervisor and cron ticks share.

``flock`` on ``<run_dir>/round.lock``: the kernel releases it when the holder exits, however
it exits (SIGKILL included), so a crashed round never leaves a stale lock behind. The lock is
also how xffl tells whether a run's supervisor is alive, and which process it is
(:func:`holder`): a recorded pid alone could by now belong to any process.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from xffl.core.layout import RunLayout

PID_WAIT_S = 1.0  # a new holder writes its pid right after taking the lock


class RoundInFlight(RuntimeError):
    """Another process holds the run's round lock."""


@contextmanager
def round_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run's round lock, or raise RoundInFlight at once if another process has it."""
    fd = os.open(RunLayout(Path(run_dir)).lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RoundInFlight(f"a round of {Path(run_dir).name} is in flight") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)


def _kernel_holder(fd: int) -> int | None:
    """The pid that holds an exclusive flock on ``fd``'s file, as the kernel lists it."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 18656 fe:00:2147102 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE" \
                and fields[5] == ident and fields[4].isdigit():
            return int(fields[4])
    return None


def _recorded(content: bytes) -> int | None:
    """The pid a holder wrote (``PID HOST``); 0 if that host is another machine."""
    fields = content.decode(errors="replace").split()
    if len(fields) != 2 or not fields[0].isdigit():
        return None
    return int(fields[0]) if fields[1] == socket.gethostname() else 0


def holder(run_dir: Path) -> int | None:
    """The pid of the process holding the run's round lock; None when no one holds it.

    The kernel's lock table names the holder; where it cannot be read, the pid the holder
    wrote into the lock file (waited for up to :data:`PID_WAIT_S` after it took the lock).
    0 stands for "held by a process this machine cannot name" (another host of a shared
    filesystem, or no pid written in time): never a pid to signal.
    """
    path = RunLayout(Path(run_dir)).lock
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        deadline = time.monotonic() + PID_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _kernel_holder(fd)
                if pid is not None:
                    return pid
                recorded = _recorded(os.pread(fd, 300, 0))
                if recorded is not None:
                    return recorded
                if time.monotonic() > deadline:
                    return 0
                time.sleep(0.01)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
    finally:
        os.close(fd)
