"""torchrun's engine with forked ranks: import torch, transformers and the rank's code once.

``python -m xffl.training.forked --nproc-per-node 2 -m xffl.training --job J ...``

A rank started by ``torchrun -m`` is a new interpreter that imports torch and transformers
again (about 3 s of CPU each on a 2-core machine, more than a quickstart round trains). Here
one interpreter imports the rank's module and what it will run (the module's
``warm_imports(argv)``, when it has one), then torch's elastic agent, configured as
``torchrun --standalone`` configures it, starts the ranks with the ``fork`` start method and
a function entry point: each rank runs the module as ``python -m`` would, with the imports
already done. Rendezvous, the ranks' environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), signal handling and failure reports are torchrun's own.

The ranks are not forked from the agent itself. By the time it starts them, its rendezvous
runs threads (the TCPStore's libuv loops, the keep-alive timer); a rank forked while one of
them holds a libc lock waits for that lock forever (seen: glibc's resolver lock, in the rank's
first ``getaddrinfo``, inside its TCPStore connect, once in a few hundred rounds on a busy
machine). So the agent uses multiprocessing's ``forkserver`` start method, and its fork server
is started as a fork of this interpreter before the agent runs (:func:`start_fork_server`):
a process with one thread, whose forks hold no lock, with every import already done.

Only for ranks that compute on the CPU: a CUDA context does not survive ``fork``, so
machines with accelerator devices keep ``torchrun``'s exec'd ranks (see
:func:`xffl.training.launch.forkable`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import runpy
import sys
import threading
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from xffl.core.startup import collect_less

PROG = "python -m xffl.training.forked"
#: the longest temporary folder whose pymp-*/listener-* socket path fits in 107 bytes
SOCKET_DIR_MAX = 64


def option_value(argv: Sequence[str], option: str) -> str | None:
    """The value of ``option`` in an argument list (``--opt V`` or ``--opt=V``), if given."""
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(f"{option}="):
            return arg.split("=", 1)[1]
    return None


def preload(module: str, argv: Sequence[str]) -> None:
    """Import ``module`` (its ``__main__`` for a package) and call its ``warm_imports(argv)``.

    A failure here is left to the ranks, which import and run the same code and report it.
    """
    try:
        spec = importlib.util.find_spec(module)
        is_package = spec is not None and spec.submodule_search_locations is not None
        code = importlib.import_module(f"{module}.__main__" if is_package else module)
        warm = getattr(code, "warm_imports", None)
        if callable(warm):
            warm(list(argv))
    except Exception:  # the ranks import it again and say what is wrong
        return


def run_module(module: str, argv: Sequence[str]) -> None:
    """One rank: ``module`` run as ``python -m module argv`` would, in this forked process."""
    sys.argv = [module, *argv]
    # a package's __main__ was imported by preload(); runpy runs it again as __main__ (its
    # imports cached) and warns when it finds the first copy, which this rank does not need
    sys.modules.pop(f"{module}.__main__", None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # a module's sys.exit(0) is a success, anything else is not
        if exc.code not in (0, None):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _fork_server_process(args: Sequence[Any], passfds: Sequence[int],
                         spawnv: Callable[..., int]) -> int:
    """What ``multiprocessing.util.spawnv_passfds`` (``spawnv``) does for the fork server's
    start, by a fork of this process: run the ``-c`` command it would exec (the fds it would
    pass, and the standard streams, kept; the rest closed, as the exec'd one has them); the
    fork's pid. The fork is left as a fresh interpreter would be: ``ensure_running``'s lock,
    held here across the fork, free again and ``spawnv`` back in place (a rank that starts a
    fork server of its own then starts one as it would anywhere)."""
    command = str(args[list(args).index("-c") + 1])
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        from multiprocessing import forkserver, util

        util.spawnv_passfds = spawnv
        forkserver._forkserver._lock = threading.Lock()  # type: ignore[attr-defined]
        low = 3
        for fd in sorted(int(f) for f in passfds if int(f) >= 3):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        exec(command, {"__name__": "__mp_forkserver__"})
        code = 0
    except SystemExit as exc:  # the server ends so when the agent is gone
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def short_temp_dir() -> None:
    """Give multiprocessing a temporary folder whose fork-server socket path fits a Unix
    socket (107 bytes): under /tmp (or /dev/shm) when the TMPDIR a site job sets is too long.

    The folder (owner-only, removed at exit) is made once per process and kept by
    multiprocessing; ``tempfile`` is left as it was for everything else.
    """
    import tempfile
    from multiprocessing import util

    saved = tempfile.tempdir
    if len(tempfile.gettempdir()) > SOCKET_DIR_MAX:
        tempfile.tempdir = next((d for d in ("/tmp", "/dev/shm")
                                 if os.access(d, os.W_OK | os.X_OK)), None)
    try:
        util.get_temp_dir()
    finally:
        tempfile.tempdir = saved


def start_fork_server() -> bool:
    """Start multiprocessing's fork server as a fork of this interpreter (its imports done);
    False, leaving multiprocessing to start it by exec (its ranks then import their code),
    when the imports started a Python thread.

    The native pools an import may start are no hazard: OpenBLAS (numpy's, loaded with torch)
    parks its threads on its own condition variable and shuts them down before any fork; what
    hung a rank was the agent's threads at work in libc.
    """
    short_temp_dir()  # the fork server's socket lives there
    if threading.active_count() > 1:
        return False
    from multiprocessing import forkserver, util

    real = util.spawnv_passfds

    def fork_instead(path: object, args: Sequence[Any], passfds: Sequence[int]) -> int:
        return _fork_server_process(args, passfds, real)

    util.spawnv_passfds = fork_instead
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = real
    return True


def launch_forked(nproc: int, module: str, argv: Sequence[str]) -> int:
    """Start ``nproc`` forked ranks of ``module`` under torch's elastic agent; the exit code."""
    # never let a CUDA probe in the agent make the forked ranks unable to use CUDA
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    preload(module, argv)
    # torchrun --standalone, as torch.distributed.run.run sets it up
    args = get_args_parser().parse_args(["--nnodes", "1", "--nproc-per-node", str(nproc),
                                         "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                         "localhost:0", "--rdzv-id",
                                         str(uuid.uuid4()), "--max-restarts", "0",
                                         "--start-method", "forkserver", "-m", module])
    config, _, _ = config_from_args(args)
    start_fork_server()  # before the agent's threads (see the module doc)
    try:
        elastic_launch(config, run_module)(module, list(argv))
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        code = first.exitcode
        return 128 - code if code < 0 else (code or 1)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry (``--nproc-per-node N -m MODULE ARGS...``)."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    parser = argparse.ArgumentParser(
        prog=PROG, description="Start a module's ranks forked from one interpreter that has "
        "imported it, under torch's elastic agent (torchrun --standalone).")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks to start")
    parser.add_argument("-m", dest="module", required=True,
                        help="the module each rank runs; the arguments after it are its own")
    given = list(sys.argv[1:] if argv is None else argv)
    split = given.index("-m") + 2 if "-m" in given else len(given)
    args = parser.parse_args(given[:split])
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    return launch_forked(args.nproc_per_node, args.module, given[split:])


if __name__ == "__main__":
    sys.exit(main())
