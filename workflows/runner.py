"""The detached runner: one process per run that drives its rounds to completion.

``xffl submit`` and ``xffl resume`` start ``python -m xffl.workflows.runner RUN_ID`` in a new
session, so that the run survives the terminal; ``xffl round`` runs one round in-process
(``execute(once=True)``). Rounds run one at a time under the run's round lock, each through
the per-site plan (:mod:`xffl.workflows.rounds`), from the round after the last completed
one: a runner started again after any stop continues where the run stood. Every state
change goes to the registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from xffl.aggregator.exchange import MANIFEST_FILE
from xffl.aggregator.shards import parse_size
from xffl.core.errors import first_line
from xffl.core.resources import peak_rss_bytes
from xffl.jobs.credential_gate import blockers
from xffl.jobs.registry import Registry
from xffl.jobs.round_lock import RoundInFlight, round_lock
from xffl.jobs.slurm_view import load_profiles
from xffl.jobs.spec import JobSpec
from xffl.workflows.aggregate_step import QuorumNotMet
from xffl.workflows.plan import PlanPaths
from xffl.workflows.rounds import run_round


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
    init_global(run_id, spec.model, spec.training.seed, paths.initial_model,
                parse_size(spec.aggregation.max_shard_size))


def _credentials_block(run_id: str, registry: Registry, spec: JobSpec, run_dir: Path,
                       once: bool) -> bool:
    """Leave the run waiting, submitting nothing, if a site's credential would not last.

    An expired or expiring SSH certificate is not a failure: the run waits with the site,
    the expiry and the renewal in its message, and continues once the credential is renewed
    (the next cron tick, or ``xffl resume``).
    """
    found = blockers(spec, load_profiles(run_dir))
    if not found:
        return False
    run = registry.get_run(run_id)
    then = ("the next `xffl round` (cron tick) continues" if once
            else f"`xffl resume {run_id}` continues")
    message = (f"round {run.rounds_done + 1} not started, nothing submitted: "
               + " ".join(b.sentence(then) for b in found))
    registry.event(run_id, "credential", message)
    registry.set_state(run_id, "waiting", message)
    print(message, flush=True)
    return True


def execute(run_id: str, registry: Registry, *, once: bool = False) -> int:
    """Drive a run from its next round to a terminal state; return the exit code.

    With ``once`` (a cron tick, ``xffl round``) run at most one round, then leave the run
    waiting for the next tick (or completed after its last round).
    """
    run = registry.get_run(run_id)
    paths = PlanPaths(Path(run.run_dir))
    try:
        spec = JobSpec.model_validate_json((paths.root / "job.json").read_text())
        with round_lock(paths.root):
            registry.set_state(run_id, "running", "runner started", started=time.time(),
                               runner_pid=os.getpid())
            ensure_initial_model(paths, run_id)
            while True:
                run = registry.get_run(run_id)
                if run.rounds_done >= run.rounds_total:
                    registry.set_state(run_id, "completed",
                                       f"{run.rounds_done} rounds completed", ended=time.time())
                    return 0
                if _credentials_block(run_id, registry, spec, paths.root, once):
                    return 0
                run_round(paths.root, run_id, run.rounds_done + 1, spec, registry)
                registry.event(run_id, "resources", f"round {run.rounds_done + 1}: "
                               f"coordinator peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
                if once and registry.get_run(run_id).rounds_done < run.rounds_total:
                    break
    except RoundInFlight as exc:
        registry.event(run_id, "tick", f"{exc}; nothing to do")
        print(f"{exc}; nothing to do", flush=True)
        return 0
    except QuorumNotMet as exc:
        registry.set_state(run_id, "failed", f"{exc}; `xffl resume {run_id}` continues from "
                           "the last completed round", ended=time.time())
        return 1
    except BaseException as exc:  # every failure must reach the registry
        traceback.print_exc()
        registry.set_state(run_id, "failed",
                           f"{first_line(exc)} (see {paths.root / 'runner.log'})",
                           ended=time.time())
        return 1
    run = registry.get_run(run_id)
    registry.set_state(run_id, "waiting",
                       f"round {run.rounds_done} of {run.rounds_total} done; the next round "
                       "starts on the next `xffl round` (cron tick)")
    return 0


def main() -> int:
    """Entry point: ``python -m xffl.workflows.runner RUN_ID``."""
    run_id = sys.argv[1]
    registry = Registry(Path(os.environ["XFFL_REGISTRY"])) if "XFFL_REGISTRY" in os.environ \
        else Registry()
    return execute(run_id, registry)


if __name__ == "__main__":
    sys.exit(main())
