"""Local sites whose ranks are forked from one warm interpreter: no torch import per rank.

Every rank a local site starts is a new interpreter that imports torch, transformers and the
trainer (about 3 CPU-s, most of a test round's cost). A site profile made by
:func:`warm_profile` sets ``XFFL_RANK_PYTHON`` (the launcher's Python for its ranks, as a
container's line sets it) to this file run as a client: instead of importing anything it
hands its module, arguments, working folder, environment and standard streams to a server
(:func:`serve`; :func:`rank_python` starts one per test process) that imported torch, the
trainer, the evaluation and the families' modeling code once; a fork of the server becomes
the rank in a process group of its own (with the client's umask) and runs the module as
``python -m`` would (as xffl.training.forked's ranks and the warm step server's steps do),
and the client exits as the rank did (a signal's death included; a client that dies takes
its rank with it). Submit, the supervisor, StreamFlow, the launcher, the rank's code and the
round's files are the product's own: only where the rank's imports come from differs.
Without a server (not up, gone) the client runs the module itself: same code, imports paid.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

from xffl.core.fork_server import become, end_as_interpreter, exit_code, serve_forks

LIMIT = 1 << 20  # bytes of one request or reply line
#: the model families the shared server imports the code of (tiny presets: llama)
FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "mixtral")
#: what every rank imports, preloaded by the server in this order (the families' code apart)
PRELOAD = ("xffl.core.startup_preload", "torch", "xffl.training.trainer",
           "xffl.training.streamed", "xffl.training.__main__", "xffl.training.evaluate_models")


def _line(stream: Any) -> dict[str, Any]:
    """One JSON line of a reply ({} when the other end closed first)."""
    raw = stream.readline(LIMIT + 1)
    return json.loads(raw) if raw.endswith(b"\n") else {}


def _run(module: str, argv: list[str]) -> int:
    """In the rank's fork: ``module`` run as ``python -m module argv`` would; its exit code."""
    import runpy

    sys.argv = [module, *argv]
    sys.modules.pop(f"{module}.__main__", None)  # preloaded: runpy runs a fresh copy
    return exit_code(lambda _: runpy.run_module(module, run_name="__main__", alter_sys=True),
                     argv)


def _rank(conn: socket.socket) -> int:
    """In a fork of the server: take a request, fork the rank, answer its pid and its end."""
    data, fds, _flags, _addr = socket.recv_fds(conn, LIMIT, 3)
    req = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setpgid(0, 0)  # a group of its own: a kill of its group reaches no test process
        become(fds, req["cwd"], req["env"])
        sys.path[0] = req["cwd"]  # python -m's first entry (the server's: this file's folder)
        os.umask(req["umask"])  # the launcher's (owner-only files at a site), not the server's
        for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path:  # as the interpreter's start-up puts it
                sys.path.insert(0, entry)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # read by torch at import, in the server
            import torch

            torch.set_num_threads(int(threads))
        code = _run(req["module"], req["argv"])
        end_as_interpreter()
        os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    ended = os.pidfd_open(pid)
    readable, _, _ = select.select([ended, conn.fileno()], [], [])
    if ended not in readable:  # the client sends nothing more: it died, and so does its rank
        os.killpg(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    with suppress(OSError):  # a client that died reads no answer
        conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    return 0


def serve(path: str, model_types: list[str], parent: int) -> None:
    """Import what ranks run, listen on ``path``, fork a handler per rank until ``parent``
    ends (or SIGTERM)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from xffl.training.model import warm_family

    for model_type in model_types:
        warm_family(model_type)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".new")
    os.replace(path + ".new", path)  # the client finds a listening socket or none
    serve_forks(sock, parent, _rank)


def client(path: str, argv: list[str]) -> int:
    """``python -m MODULE ARGS`` (``argv``) run by the server's fork; its exit code."""
    if len(argv) < 2 or argv[0] != "-m":
        os.execv(sys.executable, [sys.executable, *argv])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:  # no server: run it here
        os.execv(sys.executable, [sys.executable, *argv])
    umask = os.umask(0o077)
    os.umask(umask)
    request = {"module": argv[1], "argv": argv[2:], "cwd": os.getcwd(), "env": dict(os.environ),
               "umask": umask}
    socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    replies = sock.makefile("rb")
    pid = _line(replies).get("pid")
    if not isinstance(pid, int):
        print("warm_ranks: the server did not start the rank", file=sys.stderr)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    code = _line(replies).get("code")
    if not isinstance(code, int):
        print("warm_ranks: the rank ended without an exit code", file=sys.stderr)
        return 1
    if code < 0:  # killed by a signal: die of it too, as the launcher would see the rank
        with suppress(OSError):  # SIGKILL's cannot be set (nor caught)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def start(where: Path, model_types: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a server in ``where`` and wait for its preloads; it and the client's command
    (a script) to set as a profile's ``XFFL_RANK_PYTHON``."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "ranks.sock"
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve",
                               str(path), str(os.getpid()), *model_types],
                              stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not path.exists():
            assert server.poll() is None, f"the warm rank server ended ({server.returncode})"
            assert time.monotonic() < deadline, "the warm rank server did not start"
            time.sleep(0.1)
    except BaseException:
        stop(server)
        raise
    script = where / "rank-python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "
                      f"client {path} \"$@\"\n")
    script.chmod(0o755)
    return server, script


def stop(server: subprocess.Popen[bytes]) -> None:
    """End a server (ranks it runs finish in their forks)."""
    server.terminate()
    server.wait(timeout=30)


_SHARED: list[Path] = []


def rank_python() -> Path:
    """The client's command of this process's shared server, started at the first call
    (preloading every family FAMILIES names) and ended when this process exits."""
    if not _SHARED:
        where = Path(tempfile.mkdtemp(prefix="xffl-warm-"))  # short: a socket's path
        server, script = start(where, list(FAMILIES))
        atexit.register(shutil.rmtree, where, True)
        atexit.register(stop, server)  # runs first
        _SHARED.append(script)
    return _SHARED[0]


def warm_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``XFFL_RANK_PYTHON`` set to the shared server's
    client: a launcher started with it forks its ranks' engine (and so its ranks) from the
    server instead of importing torch and the trainer again."""
    return {**(os.environ if env is None else env), "XFFL_RANK_PYTHON": str(rank_python())}


def warm_profile(profiles: Path, script: Path | None = None, name: str = "warm-local") -> str:
    """A local site profile (in the folder ``profiles``) whose ranks are the server's
    (``script``; default: the shared one); its name."""
    script = script or rank_python()
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / f"{name}.yaml").write_text(json.dumps({
        "name": name, "connector": {"type": "local"}, "launcher": "torchrun",
        "env": {"XFFL_RANK_PYTHON": str(script)}}))
    return name


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
        serve(sys.argv[2], sys.argv[4:], int(sys.argv[3]))
    elif sys.argv[1:2] == ["client"]:
        sys.exit(client(sys.argv[2], sys.argv[3:]))
