"""Resume a run after any stop: start a runner that continues from the last completed round."""

from __future__ import annotations

from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.jobs.credential_gate import require_credentials
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import load_profiles
from xffl.jobs.spec.schema import JobSpec
from xffl.jobs.status import runner_alive, settle
from xffl.workflows.supervisor import spawn


def resume_run(registry: Registry, run: RunRecord) -> int:
    """Start a detached runner for ``run``; return its pid.

    Allowed from any state but completed, unless a runner of the run is still alive. The
    runner continues with round ``rounds_done + 1``; updates that already arrived for that
    round are reused, so no finished training or round is computed again.
    """
    run = settle(registry, run)
    if run.state == RunState.COMPLETED:
        raise InvalidInput(f"run {run.id} is completed ({run.rounds_done} rounds): nothing to "
                           "resume; submit the job again for a new run.")
    if runner_alive(run) and run.state in (RunState.RUNNING, RunState.SUBMITTED):
        raise InvalidInput(f"run {run.id} is {run.state} (its supervisor is alive); "
                           f"`xffl cancel {run.id}` first to restart it.")
    run_dir = Path(run.run_dir)
    spec = JobSpec.of_run(run_dir)
    require_credentials(spec, load_profiles(run_dir), then=f"run `xffl resume {run.id}` again")
    registry.set_state(run.id, RunState.SUBMITTED,
                       f"resumed from round {run.rounds_done + 1} (was {run.state})",
                       ended=None)
    pid = spawn(run.id, Path(run.run_dir), registry.path)
    registry.event(run.id, "runner", f"supervisor spawned (pid {pid})")
    return pid
