"""Follow a run until it ends (bounded), reporting progress through a callback."""

from __future__ import annotations

import time
from collections.abc import Callable

from xffl.core.errors import TimedOut
from xffl.jobs.registry import Registry, RunRecord
from xffl.jobs.status import runner_alive


def wait_for_run(registry: Registry, run_id: str, timeout: float,
                 on_update: Callable[[RunRecord], None] | None = None,
                 poll: float = 0.5) -> RunRecord:
    """Poll the registry until the run is finished; TimedOut after ``timeout`` seconds.

    A runner that died without recording an outcome marks the run failed.
    """
    deadline = time.monotonic() + timeout
    grace_until = time.monotonic() + 10.0
    while True:
        run = registry.get_run(run_id)
        if on_update is not None:
            on_update(run)
        if run.finished:
            return run
        if run.runner_pid and not runner_alive(run) and time.monotonic() > grace_until:
            run = registry.get_run(run_id)
            if not run.finished:
                registry.set_state(run_id, "failed", "the supervisor process died without "
                                   f"recording an outcome; see {run.run_dir}/supervisor.log",
                                   ended=time.time())
                return registry.get_run(run_id)
            return run
        if time.monotonic() > deadline:
            raise TimedOut(f"run {run_id} still {run.state} after {timeout:.0f} s; it goes on "
                           f"in the background: follow it with `xffl status {run_id}`.")
        time.sleep(poll)
