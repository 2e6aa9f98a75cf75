"""The warm step server: the coordinator's steps run in forks of one process that imported them.

Each round runs one admit step per site and one aggregate step on the coordinator, each a
new Python process; nearly all of such a process's CPU time went to its imports (numpy,
pydantic and the job spec's models: 0.41 of 0.45 CPU-s), and the last admission and the
aggregation are on the round's critical path. The supervisor starts this server for the time
its workflow runs (``python -m xffl.workflows.steps.warm RUN_DIR``). It imports the steps'
modules once (and the libraries of the trackers the job logs to: MLflow's client), listens
on ``steps.sock`` in the run directory (a Unix socket, owner-only as every file the run
makes; a peer of another user is refused by its credentials), and for each step
:mod:`xffl.workflows.steps.handoff` hands it, forks: the fork takes the step's arguments,
working directory, environment and standard streams (passed as file
descriptors), runs the step's ``main`` as ``python -m`` would, and answers its exit code.
The request is JSON; nothing is unpickled. Only the plan's coordinator steps can be asked
for. The server ends when its supervisor does (it checks its parent every second) or on
SIGTERM. (:mod:`multiprocessing`'s forkserver forks preloaded processes too, but for its own
``Process`` objects, not for a command handed a process's streams.)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from xffl.core.fork_server import become, end_as_interpreter, exit_code, serve_forks
from xffl.core.paths import private_files
from xffl.core.startup import collect_less
from xffl.workflows.steps.handoff import LIMIT, SOCKET, STEPS

STREAMS = 3  # the step's stdin, stdout, stderr


def spawn(run_dir: Path) -> subprocess.Popen[bytes]:
    """Start the warm step server of ``run_dir`` (its output goes where this process's does)."""
    return subprocess.Popen([sys.executable, "-m", "xffl.workflows.steps.warm", str(run_dir)],
                            stdin=subprocess.DEVNULL)


def stop(server: subprocess.Popen[bytes]) -> None:
    """End the server (a step it is running finishes in its fork)."""
    if server.poll() is None:
        server.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=10)


def _request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The step's request and its standard streams (ValueError: not a valid request)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, LIMIT, STREAMS)
    while not data.endswith(b"\n") and len(data) <= LIMIT:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    req = json.loads(data)
    if (len(fds) != STREAMS or not isinstance(req, dict) or req.get("step") not in STEPS
            or not isinstance(req.get("cwd"), str)
            or not isinstance(req.get("argv"), list)
            or not all(isinstance(a, str) for a in req["argv"])
            or not isinstance(req.get("env"), dict)
            or not all(isinstance(k, str) and isinstance(v, str)
                       for k, v in req["env"].items())):
        raise ValueError("not a step request")
    return req, fds


def run_fork(conn: socket.socket, modules: dict[str, ModuleType]) -> int:
    """In the fork: take the request, become the step's process, run it, answer its code."""
    try:
        req, fds = _request(conn)
    except (OSError, ValueError):
        return 2
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    become(fds, req["cwd"], req["env"])
    module = modules[req["step"]]
    sys.argv = [module.__name__, *req["argv"]]
    code = exit_code(module.main, req["argv"])
    end_as_interpreter()
    conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    return code


def preload(run_dir: Path) -> None:
    """Import what the run's steps import only when its job asks for it: the experiment
    trackers' libraries (``tracking``; MLflow's client costs each round's aggregate step about
    3 CPU-seconds otherwise). A failure here is left to the step, which reports it."""
    try:
        from xffl.jobs.spec.schema import JobSpec

        spec = JobSpec.of_run(run_dir)
        if spec.tracking is not None:
            from xffl.jobs.tracking.rounds import warm_imports

            warm_imports(spec.tracking)
    except Exception:  # the step imports the same and says what is wrong
        return


def serve(run_dir: Path, parent: int) -> None:
    """Import the steps, listen in ``run_dir``, fork a process per step until ``parent`` ends."""
    modules = {s: importlib.import_module(f"xffl.workflows.steps.{s}") for s in STEPS}
    preload(run_dir)
    os.chdir(run_dir)  # a relative name: a run directory's path may pass AF_UNIX's limit
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(SOCKET)  # 0600: the process's umask is owner-only
    try:
        serve_forks(sock, parent, lambda conn: run_fork(conn, modules))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(SOCKET)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m xffl.workflows.steps.warm RUN_DIR``."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    private_files()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m xffl.workflows.steps.warm RUN_DIR", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
    serve(Path(args[0]), os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
