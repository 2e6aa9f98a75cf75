"""How ``python -m xffl.workflows.steps STEP ARGS...`` runs one coordinator step, warm if it can.

The plan's coordinator tools (admit, aggregate, final_validation) run through that entry
point (``__main__``, which calls :func:`main`). While a supervisor runs the workflow, its
warm step server (:mod:`xffl.workflows.steps.warm`) listens in the run directory with the
steps' modules imported; this process, which imports nothing but this module and the
standard library, hands the step to it (its arguments, working directory, environment and
standard streams) and exits with the step's exit code. Without a server (cwltool, a server
not up yet or gone) it runs the step itself, as ``python -m xffl.workflows.steps.STEP
ARGS...`` would: same code, same result, only the imports are paid here.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import sys
from typing import BinaryIO

STEPS = ("admit", "aggregate", "final_validation")
SOCKET = "steps.sock"  # in the run directory
LIMIT = 1 << 20  # bytes of one request or reply line


def run_dir_of(argv: list[str]) -> str | None:
    """The step's ``--run-dir`` (every coordinator step has one), or None."""
    for i, word in enumerate(argv):
        if word == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--run-dir="):
            return word.partition("=")[2]
    return None


def connect(run_dir: str) -> socket.socket | None:
    """A connection to the run's warm step server, or None when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    here = os.open(".", os.O_RDONLY)
    try:
        # a relative name: a run directory's path may pass AF_UNIX's 107 bytes
        os.chdir(run_dir)
        sock.connect(SOCKET)
    except OSError:
        sock.close()
        return None
    finally:
        os.fchdir(here)
        os.close(here)
    return sock


def read_line(stream: BinaryIO) -> bytes:
    """One newline-ended line of the server's replies (b"" when it closes first). The replies
    are read through one buffered ``stream``: the step's start and end lines may arrive in one
    packet (a step that ends at once), and a line read off the socket by itself would swallow
    the next."""
    line = stream.readline(LIMIT + 1)
    if len(line) > LIMIT:
        raise ValueError("a line over the limit")
    return line if line.endswith(b"\n") else b""


def warm(sock: socket.socket, step: str, argv: list[str]) -> int:
    """Run ``step`` in the server's fork (here, if the server does not start it); relay
    SIGTERM/SIGINT to it; its exit code."""
    request = {"step": step, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = sock.makefile("rb")
    started = json.loads(read_line(replies) or b"{}")
    pid = started.get("pid")
    if not isinstance(pid, int):  # the server did not start it: nothing ran
        return cold(step, argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    ended = json.loads(read_line(replies) or b"{}")
    code = ended.get("exit")
    if not isinstance(code, int):
        print(f"xffl: the {step} step ended without an exit code", file=sys.stderr)
        return 1
    return code


def cold(step: str, argv: list[str]) -> int:
    """Run ``step`` in this process."""
    module = importlib.import_module(f"xffl.workflows.steps.{step}")
    sys.argv = [f"xffl.workflows.steps.{step}", *argv]
    code: int = module.main(argv)
    return code


def main(argv: list[str]) -> int:
    """Run the step named first in ``argv`` with the rest, warm when a server listens."""
    if not argv or argv[0] not in STEPS:
        print(f"usage: python -m xffl.workflows.steps {{{','.join(STEPS)}}} ARGS...",
              file=sys.stderr)
        return 2
    step, rest = argv[0], argv[1:]
    run_dir = run_dir_of(rest)
    sock = connect(run_dir) if run_dir else None
    if sock is None:
        return cold(step, rest)
    with sock:
        return warm(sock, step, rest)
