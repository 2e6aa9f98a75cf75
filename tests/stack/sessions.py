"""The stack's sshd sessions as processes: find the one serving a command, and drop it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def session_serving(*words: str) -> int | None:
    """The pid of the sshd session process (``sshd: USER@notty``, ``sshd-session: ...``)
    above a running command whose command line holds every one of ``words``, if any."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not all(w in _cmdline(int(entry)) for w in words):
            continue
        pid = int(entry)
        while pid > 1:
            line = _cmdline(pid)
            if line.startswith("sshd") and "@" in line:
                return pid
            pid = _parent(pid)
    return None


def kill_session(pid: int) -> str:
    """SIGKILL the sshd session process ``pid``; return its command line, timed."""
    line = _cmdline(pid)
    os.kill(pid, signal.SIGKILL)
    return f"{time.strftime('%H:%M:%S')} {pid} {line}"
