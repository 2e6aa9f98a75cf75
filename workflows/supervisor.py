"""The supervisor: one process per run that executes the run's ``main.cwl`` with StreamFlow.

``xffl submit`` and ``xffl resume`` start ``python -m xffl.workflows.supervisor RUN_ID`` in a
new session (so the run survives the terminal); ``xffl round`` runs one round in the
foreground (``execute(once=True)``). Either way it is the same plan: the run directory's
``streamflow.yml`` and ``main.cwl``, run through StreamFlow's Python API (what ``streamflow
run`` does) as one workflow, from the round after the last completed one. A whole run is one
StreamFlow workflow named after the run; a resumed run or a cron tick is one more, whose
inputs (``executions/<name>.yml``) start from the last completed round's global model.

The supervisor starts the workflow, watches it (a failed step ends it at once: StreamFlow
does not always end a workflow whose loop lost a step), and records the run's state. The
plan's own steps record the rounds (admit and aggregate write to the registry named in
``run.json``) and the final model's held-out loss (main.cwl's final evaluation,
:mod:`xffl.workflows.steps.final_validation`); a completed run's message says which site
that evaluation is missing, if any. Site failures, retries, quorum
and round timeouts happen inside the workflow, through xffl's StreamFlow plugin
(:mod:`xffl.workflows.extensions.failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from xffl.core.errors import first_line
from xffl.core.layout import RunLayout
from xffl.core.paths import private_files
from xffl.core.resources import peak_rss_bytes
from xffl.core.startup import collect_less
from xffl.jobs.credential_gate import blockers
from xffl.jobs.registry.records import RunRecord
from xffl.jobs.registry.round_lock import RoundInFlight, round_lock
from xffl.jobs.registry.states import RunState
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import load_profiles
from xffl.jobs.spec.schema import JobSpec
from xffl.jobs.spec.trust import consented
from xffl.workflows.plan.compile import write_execution_inputs, write_initial_model
from xffl.workflows.steps import warm
from xffl.workflows.steps.aggregate import QUORUM_EVENT
from xffl.workflows.steps.early_stop import read_stopped
from xffl.workflows.steps.final_validation import EVENT as FINAL_EVENT
from xffl.workflows.steps.final_validation import partial


def spawn(run_id: str, run_dir: Path, registry: Path) -> int:
    """Start the supervisor of ``run_id`` detached from this process; return its pid."""
    layout = RunLayout(run_dir)
    log = layout.supervisor_log.open("ab")
    env = {**os.environ, "XFFL_REGISTRY": str(registry)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "xffl.workflows.supervisor", run_id],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, close_fds=True, cwd=run_dir, env=env,
    )
    log.close()
    return proc.pid


def completion(run: RunRecord, layout: RunLayout) -> str | None:
    """How a run with no round left to run completed: all its rounds, or an early stop
    (training.stop_when) after its last recorded round; None while rounds remain."""
    stopped = read_stopped(layout)
    if stopped is not None and stopped.round == run.rounds_done:
        return f"{run.rounds_done} of {run.rounds_total} rounds completed; {stopped.reason}"
    if run.rounds_done >= run.rounds_total:
        return f"{run.rounds_done} rounds completed"
    return None


def execution_name(run: RunRecord, first: int, last: int) -> str:
    """The StreamFlow workflow name of one execution: the run id for a whole run."""
    if first == 1 and last == run.rounds_total:
        return run.id
    return f"{run.id}-r{first}-{time.strftime('%Y%m%d-%H%M%S')}"


async def _execute(layout: RunLayout, run_id: str, spec: JobSpec, name: str, first: int,
                   last: int, on_start: Callable[[], None]) -> None:
    """Run main.cwl for rounds ``first``..``last`` as the StreamFlow workflow ``name``.

    ``on_start`` is called when the translated workflow starts executing.
    """
    from xffl.workflows.streamflow_run import execute_workflow, load_config, open_context

    config = load_config(layout.streamflow)
    if (first, last) != (1, spec.rounds):
        inputs = write_execution_inputs(layout, spec, name, first, last)
        config["workflows"][run_id]["config"]["settings"] = str(inputs)
    context, pristine = open_context(config)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    if task is not None:  # xffl cancel: stop StreamFlow, whose connectors scancel the jobs
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    server = warm.spawn(layout.root)  # the coordinator's steps, imported once for the run
    try:
        await execute_workflow(context, pristine, run_id, name,
                               layout.workflow_outputs(name), on_start=on_start)
    finally:
        warm.stop(server)
        loop.remove_signal_handler(signal.SIGTERM)
        with contextlib.suppress(Exception):
            await context.close()


def _credentials_block(run: RunRecord, registry: Registry, spec: JobSpec, layout: RunLayout,
                       once: bool) -> bool:
    """Leave the run waiting, submitting nothing, if a site's credential would not last.

    An expired or expiring SSH certificate is not a failure: the run waits with the site,
    the expiry and the renewal in its message, and continues once the credential is renewed
    (the next cron tick, or ``xffl resume``).
    """
    found = blockers(spec, load_profiles(layout.root))
    if not found:
        return False
    then = ("the next `xffl round` (cron tick) continues" if once
            else f"`xffl resume {run.id}` continues")
    message = (f"round {run.rounds_done + 1} not started, nothing submitted: "
               + " ".join(b.sentence(then) for b in found))
    registry.event(run.id, "credential", message)
    registry.set_state(run.id, RunState.WAITING, message)
    print(message, flush=True)
    return True


def _failure_message(registry: Registry, run_id: str, since: float, errors: list[str],
                     exc: BaseException, layout: RunLayout) -> str:
    """Why an execution failed: a round's quorum, else StreamFlow's first error."""
    quorum = [m for ts, kind, m in registry.events(run_id) if kind == QUORUM_EVENT and ts >= since]
    if quorum:
        return f"{quorum[-1]}; `xffl resume {run_id}` continues from the last completed round"
    detail = errors[0] if errors else first_line(exc)
    return f"{detail} (see {layout.streamflow_log})"


def _run(run: RunRecord, registry: Registry, spec: JobSpec, layout: RunLayout,
         once: bool) -> int:
    """Execute the run's next rounds (one with ``once``); record the outcome."""
    first = run.rounds_done + 1
    last = first if once else run.rounds_total
    name = execution_name(run, first, last)
    registry.event(run.id, "execution", f"StreamFlow workflow {name}: rounds {first}-{last}")
    if first == 1 and spec.round_deadline is not None and not registry.queue_estimates(run.id):
        from xffl.jobs.slurm_estimate import seed_estimates

        seed_estimates(registry, run, {s.name: s.ranks for s in spec.sites})

    def start() -> None:  # the round starts with the workflow (StreamFlow set up before it)
        registry.start_round(run.id, first, run.sites)
    from streamflow.log_handler import logger as sf_logger

    from xffl.workflows.streamflow_run import ErrorLines, logging_to

    errors = ErrorLines()
    sf_logger.addHandler(errors)
    started = time.time()

    try:
        with logging_to(layout.streamflow_log):
            asyncio.run(_execute(layout, run.id, spec, name, first, last, start))
    except (Exception, asyncio.CancelledError) as exc:
        if registry.get_run(run.id).state == RunState.CANCELLED:
            return 1
        traceback.print_exc()
        registry.set_state(run.id, RunState.FAILED, _failure_message(
            registry, run.id, started, errors.messages, exc, layout), ended=time.time())
        return 1
    finally:
        sf_logger.removeHandler(errors)
        registry.event(run.id, "resources", f"rounds {first}-{last}: supervisor peak RSS "
                       f"{peak_rss_bytes() / 2**20:.0f} MiB")
    done = registry.get_run(run.id)
    finished = completion(done, layout)
    if finished is not None:
        notes = [m for ts, kind, m in registry.events(run.id)
                 if kind == FINAL_EVENT and ts >= started]
        if notes and partial(notes[-1]):  # the final evaluation lacks a site
            finished = f"{finished}; {notes[-1]}"
        registry.set_state(run.id, RunState.COMPLETED, finished, ended=time.time())
    elif done.rounds_done < last:  # the workflow ended without recording its rounds
        registry.set_state(run.id, RunState.FAILED, f"the workflow ended after round "
                           f"{done.rounds_done}, not {last} (see {layout.streamflow_log})",
                           ended=time.time())
        return 1
    else:
        registry.set_state(run.id, RunState.WAITING, f"round {done.rounds_done} of "
                           f"{done.rounds_total} done; the next round starts on the next "
                           "`xffl round` (cron tick)")
    return 0


def execute(run_id: str, registry: Registry, *, once: bool = False) -> int:
    """Drive a run from its next round to a terminal state; return the exit code.

    With ``once`` (a cron tick, ``xffl round``) run at most one round, then leave the run
    waiting for the next tick (or completed after its last round). A run that is cancelled,
    completed or failed when the round lock is taken is left as it is.
    """
    run = registry.get_run(run_id)
    layout = RunLayout(Path(run.run_dir))
    try:
        spec = JobSpec.of_run(layout.root)
        with round_lock(layout.root):
            try:
                return _execute_locked(run_id, registry, spec, layout, once)
            except BaseException as exc:  # recorded while the lock still says who runs it
                _record_crash(registry, run_id, exc, layout)
                return 1
    except RoundInFlight as exc:
        registry.event(run_id, "tick", f"{exc}; nothing to do")
        print(f"{exc}; nothing to do", flush=True)
        return 0
    except BaseException as exc:  # the job file could not be read: no lock was taken
        _record_crash(registry, run_id, exc, layout)
        return 1


def _record_crash(registry: Registry, run_id: str, exc: BaseException,
                  layout: RunLayout) -> None:
    """Every failure must reach the registry; if even that fails (a full disk), say so.

    A run left ``running`` by a supervisor that could not record its end is recognised by
    its free round lock (:func:`xffl.jobs.status.settle`).
    """
    traceback.print_exc()
    try:
        registry.set_state(run_id, RunState.FAILED,
                           f"{first_line(exc)} (see {layout.supervisor_log})", ended=time.time())
    except Exception as again:
        print(f"could not record the failure in the registry: {first_line(again)}", flush=True)


def _execute_locked(run_id: str, registry: Registry, spec: JobSpec, layout: RunLayout,
                    once: bool) -> int:
    """:func:`execute`, with the run's round lock held."""
    run = registry.get_run(run_id)  # what it is now that no one else runs it
    if run.state == RunState.CANCELLED or (
            once and run.state in (RunState.COMPLETED, RunState.FAILED)):
        print(f"run {run.id} is {run.state}: no round to run", flush=True)
        return 0
    registry.set_state(run_id, RunState.RUNNING, "supervisor started", started=time.time(),
                       runner_pid=os.getpid())
    write_initial_model(layout, spec, run_id, trusted=consented(layout.root, spec))
    finished = completion(run, layout)
    if finished is not None:
        registry.set_state(run_id, RunState.COMPLETED, finished, ended=time.time())
        return 0
    if _credentials_block(run, registry, spec, layout, once):
        return 0
    return _run(registry.get_run(run_id), registry, spec, layout, once)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m xffl.workflows.supervisor RUN_ID``."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    args: list[str] = sys.argv[1:] if argv is None else argv
    private_files()
    registry = Registry(Path(os.environ["XFFL_REGISTRY"])) if "XFFL_REGISTRY" in os.environ \
        else Registry()
    return execute(args[0], registry)


if __name__ == "__main__":
    sys.exit(main())

