"""The detached runner: one process per run that drives its plan to completion.

``xffl submit`` starts ``python -m xffl.workflows.runner RUN_ID`` in a new session, so that
the run survives the terminal. The runner records every state change in the registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from xffl.aggregator.exchange import MANIFEST_FILE
from xffl.jobs.registry import Registry, RoundRecord, SiteRound
from xffl.jobs.spec import JobSpec
from xffl.workflows.plan import PlanPaths
from xffl.workflows.streamflow_run import StepFailed, run_plan


def spawn(run_id: str, run_dir: Path, registry: Path) -> int:
    """Start the runner for ``run_id`` detached from this process; return its pid."""
    log = (run_dir / "runner.log").open("ab")
    env = {**os.environ, "XFFL_REGISTRY": str(registry)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "xffl.workflows.runner", run_id],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, close_fds=True, cwd=run_dir, env=env,
    )
    log.close()
    return proc.pid


def ensure_initial_model(paths: PlanPaths, run_id: str) -> None:
    """Write the round-0 global checkpoint (the seeded initial model) unless it exists."""
    if (paths.initial_model / MANIFEST_FILE).is_file():
        return
    from xffl.training.trainer import init_global  # torch is heavy: import only when needed

    spec = JobSpec.model_validate_json((paths.root / "job.json").read_text())
    init_global(run_id, spec.model, spec.training.seed, paths.initial_model)


def _record_step_failure(registry: Registry, run_id: str, step: str, root: Path) -> None:
    """Mark the failed site (or aggregation) in the round that was running."""
    run = registry.get_run(run_id)
    rnd = run.rounds_done + 1
    name = step.rsplit("/", 1)[-1]
    sites = []
    for site in run.sites:
        failed = name == f"train_{site}"
        reason = (f"training job failed; see {root / 'streamflow.log'}" if failed
                  else "round aborted: another step failed")
        state = "failed" if failed else "aborted"
        sites.append(SiteRound(site=site, state=state, reason=reason))
    registry.finish_round(run_id, RoundRecord(round=rnd, state="failed", ended=time.time(),
                                              sites=sites))


def execute(run_id: str, registry: Registry) -> int:
    """Drive one run from its current state to a terminal state; return the exit code."""
    run = registry.get_run(run_id)
    paths = PlanPaths(Path(run.run_dir))
    registry.set_state(run_id, "running", "runner started", started=time.time(),
                       runner_pid=os.getpid())
    try:
        ensure_initial_model(paths, run_id)
        registry.start_round(run_id, run.rounds_done + 1, run.sites)
        run_plan(paths, run_id, log_file=paths.root / "streamflow.log")
    except StepFailed as exc:
        _record_step_failure(registry, run_id, exc.step, paths.root)
        registry.set_state(run_id, "failed", f"{exc} (see {paths.root / 'streamflow.log'})",
                           ended=time.time())
        return 1
    except BaseException as exc:  # every failure must reach the registry
        traceback.print_exc()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        registry.set_state(run_id, "failed", f"{reason} (see {paths.root / 'streamflow.log'})",
                           ended=time.time())
        return 1
    final = registry.get_run(run_id)
    if final.rounds_done < final.rounds_total:
        registry.set_state(run_id, "failed",
                           f"the workflow ended after {final.rounds_done} of "
                           f"{final.rounds_total} rounds", ended=time.time())
        return 1
    registry.set_state(run_id, "completed", f"{final.rounds_done} rounds completed",
                       ended=time.time())
    return 0


def main() -> int:
    """Entry point: ``python -m xffl.workflows.runner RUN_ID``."""
    run_id = sys.argv[1]
    registry = Registry(Path(os.environ["XFFL_REGISTRY"])) if "XFFL_REGISTRY" in os.environ \
        else Registry()
    return execute(run_id, registry)


if __name__ == "__main__":
    sys.exit(main())
