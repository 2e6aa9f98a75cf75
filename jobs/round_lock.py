"""One round at a time per run: an exclusive lock file that the runner and cron ticks share.

``flock`` on ``<run_dir>/round.lock``: the kernel releases it when the holder exits, however
it exits (SIGKILL included), so a crashed round never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = "round.lock"


class RoundInFlight(RuntimeError):
    """Another process holds the run's round lock."""


@contextmanager
def round_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run's round lock, or raise RoundInFlight at once if another process has it."""
    fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RoundInFlight(f"a round of {Path(run_dir).name} is in flight") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)
