"""Follow a run until it ends (bounded), reporting progress through a callback; the new
lines of a growing log file (:class:`Tail`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from xffl.core.errors import TimedOut
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry
from xffl.jobs.status import settle


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited (it is reaped then)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child, or already reaped
        return True
    return done == pid


def wait_for_run(registry: Registry, run_id: str, timeout: float,
                 on_update: Callable[[RunRecord], None] | None = None,
                 poll: float = 0.5, spawned: int | None = None) -> RunRecord:
    """Poll the registry until the run is finished; TimedOut after ``timeout`` seconds.

    A supervisor that died without recording an outcome leaves the run failed
    (:func:`xffl.jobs.status.settle`); so does ``spawned``, the supervisor this process
    started, exiting before it took the run over.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = settle(registry, registry.get_run(run_id))
        if on_update is not None:
            on_update(run)
        if run.finished:
            return run
        if spawned is not None and run.state == RunState.SUBMITTED and _exited(spawned):
            run = registry.get_run(run_id)
            if run.state == RunState.SUBMITTED:
                registry.set_state(run_id, RunState.FAILED, "the supervisor exited before it "
                                   f"started the run; see {run.run_dir}/supervisor.log",
                                   ended=time.time())
            continue
        if time.monotonic() > deadline:
            raise TimedOut(f"run {run_id} still {run.state} after {timeout:.0f} s; it goes on "
                           f"in the background: follow it with `xffl status {run_id}`.")
        time.sleep(poll)


class Tail:
    """The complete lines a file gained since the last read (none while it does not exist;
    a line still being written waits for its newline)."""

    def __init__(self, path: Path) -> None:
        """Follow ``path`` from its start."""
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[str]:
        """The new complete lines, decoded (undecodable bytes replaced)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        *done, self.partial = (self.partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in done]
