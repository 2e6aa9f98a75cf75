"""A preloaded process that forks one child per connection on a Unix socket (no exec, no import).

The coordinator's warm step server (:mod:`xffl.workflows.steps.warm`) is one; the test suite's
warm rank server is another. The socket lives in an owner-only folder and a peer of another
user is refused by its credentials (SO_PEERCRED) all the same.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of ``conn`` (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def exit_code(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    """Run ``main(argv)``; its exit code as the interpreter would make it (an int it returns,
    ``SystemExit``'s code, 1 with the traceback printed for any other exception)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # as an uncaught exception would: its traceback, exit 1
        traceback.print_exc()
        return 1
    return code if isinstance(code, int) else 0


def become(fds: Sequence[int], cwd: str, env: Mapping[str, str]) -> None:
    """In a fork: take the client's standard streams (``fds``, closed here), working folder
    and environment, as the process it stands in for would have them."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)


def end_as_interpreter() -> None:
    """In a fork, before ``os._exit``: what the interpreter does at exit and ``os._exit``
    skips (the ``atexit`` functions, flushing stdout and stderr)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def reap(_signum: int = 0, _frame: object = None) -> None:
    """Collect the forks that have ended, as they end (their CPU time then counts as this
    process's children's, where ``/proc`` and ``getrusage`` show it)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def serve_forks(sock: socket.socket, parent: int,
                child: Callable[[socket.socket], int]) -> None:
    """Accept connections on the bound ``sock`` until this process's parent is no longer
    ``parent`` (checked every second); each from this user is handed to ``child`` in a fork,
    whose return value is the fork's exit code (SIGCHLD and SIGTERM back to their defaults
    there)."""
    sock.listen(16)
    sock.settimeout(1.0)
    signal.signal(signal.SIGCHLD, reap)
    while os.getppid() == parent:
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            if peer_uid(conn) != os.getuid():
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                sock.close()
                code = 2
                try:
                    for sig in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(sig, signal.SIG_DFL)
                    code = child(conn)
                finally:
                    os._exit(code)
