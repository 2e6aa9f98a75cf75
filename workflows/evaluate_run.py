"""Run a round's cross-site evaluation with StreamFlow, in this process, and record it.

The workflow is the one :mod:`xffl.workflows.plan.evaluation` writes into the run directory,
run with StreamFlow's Python API as the supervisor runs ``main.cwl``
(:mod:`xffl.workflows.streamflow_run`), as one StreamFlow workflow per evaluation, within a
bounded time. Each site's file comes back into the execution's output folder; the
coordinator reads it as untrusted input (:mod:`xffl.workflows.steps.evaluate_result`). A site
whose evaluation failed, or whose file is rejected, is a failed row with its reason; the
other rows are recorded in the registry's ``evaluations`` table.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from xffl.core.errors import InvalidInput, RunFailed, TimedOut, first_line
from xffl.core.layout import RunLayout
from xffl.jobs.registry.attempts import read_attempts
from xffl.jobs.registry.records import EvalCell, RunRecord
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import load_profiles
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.plan.evaluate_tool import result_name
from xffl.workflows.plan.evaluation import WORKFLOW, EvaluationPlan, write_evaluation
from xffl.workflows.steps.evaluate_result import (
    EvaluationRejected,
    SiteEvaluation,
    parse_evaluation,
)

EVENT = "evaluation"
CANCEL_WAIT_S = 30.0  # for the steps still running when the evaluation ends early


@dataclass(frozen=True)
class SiteRow:
    """One data site's row: its result, or why there is none."""

    site: str
    result: SiteEvaluation | None = None
    error: str | None = None


@dataclass(frozen=True)
class Outcome:
    """A finished cross-site evaluation: the models, and every site's row."""

    run_id: str
    round: int
    models: list[str]
    rows: list[SiteRow]
    seconds: float

    @property
    def failed(self) -> list[SiteRow]:
        """The rows without a result."""
        return [r for r in self.rows if r.result is None]

    def cells(self) -> list[EvalCell]:
        """The matrix's cells, as the registry stores them."""
        return [EvalCell(self.round, row.site, model, loss, row.result.samples)
                for row in self.rows if row.result is not None
                for model, loss in row.result.losses.items()]


async def _execute(layout: RunLayout, name: str, outdir: Path, timeout: float) -> None:
    """Run the evaluation workflow as the StreamFlow workflow ``name``, at most ``timeout`` s."""
    from xffl.workflows.streamflow_run import execute_workflow, load_config, open_context

    config = load_config(layout.streamflow_evaluate)
    # each site's failed attempts are written into this execution's own folder
    config["failureManager"]["config"]["run_dir"] = str(outdir)
    context, pristine = open_context(config)
    me, loop = asyncio.current_task(), asyncio.get_running_loop()
    if me is not None and threading.current_thread() is threading.main_thread():
        # xffl cancel (of a run in its final evaluation): stop StreamFlow, whose connectors
        # scancel the jobs, as the supervisor does for main.cwl
        loop.add_signal_handler(signal.SIGTERM, me.cancel)
    try:
        await asyncio.wait_for(execute_workflow(context, pristine, WORKFLOW, name, outdir),
                               timeout)
    finally:
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGTERM)
        # steps still running (a timeout, a failed step): cancelled and their ends collected
        # here, not reported by asyncio.run's shutdown after StreamFlow is closed
        steps = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in steps:
            task.cancel()
        if steps:
            await asyncio.wait(steps, timeout=CANCEL_WAIT_S)
            for task in steps:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a cancelled step's error is no news
        with contextlib.suppress(Exception):
            await context.close()  # StreamFlow's connectors cancel what still runs


def site_row(plan: EvaluationPlan, outdir: Path, site: str) -> SiteRow:
    """``site``'s row from the file it sent back, or the reason it has none: whatever is
    wrong with one site's file costs that row only, never the matrix."""
    path = outdir / result_name(site)
    if not path.exists() and not path.is_symlink():
        attempts = read_attempts(RunLayout(outdir), plan.round, site)
        why = attempts.reason if attempts is not None else "no evaluation file came back"
        return SiteRow(site, error=f"the evaluation at the site failed: {why}")
    try:
        return SiteRow(site, result=parse_evaluation(path, site, plan.models,
                                                     plan.budgets[site], plan.seq_lens[site]))
    except EvaluationRejected as exc:
        return SiteRow(site, error=f"its evaluation file was rejected: {exc}")
    except Exception as exc:  # a problem parse_evaluation did not foresee: still this row's
        return SiteRow(site, error=f"its evaluation file was rejected: {first_line(exc)}")


def evaluate_run(registry: Registry, record: RunRecord, rnd: int, timeout: float,
                 final: bool = False) -> Outcome:
    """Evaluate round ``rnd`` of ``record`` at every site; record and return the matrix
    (``final``: round ``rnd``'s global model alone, returned unrecorded:
    :mod:`xffl.workflows.final_evaluation` records what it makes of it)."""
    from streamflow.log_handler import logger as sf_logger

    from xffl.workflows.streamflow_run import ErrorLines, logging_to

    if not 1 <= rnd <= record.rounds_done:
        raise InvalidInput(f"run {record.id} has completed rounds 1..{record.rounds_done}; "
                           f"round {rnd} cannot be evaluated" + (
                               " yet" if rnd > record.rounds_done else "") + ".")
    layout = RunLayout(Path(record.run_dir))
    spec = JobSpec.of_run(layout.root)
    profiles = load_profiles(layout.root)
    if set(profiles) != {s.name for s in spec.sites}:
        raise InvalidInput(f"run {record.id} has no resolved site profiles (profiles.json); "
                           "it was planned by an older xffl.")
    plan = write_evaluation(layout, record.id, spec, profiles, rnd, final)
    kind = "final" if final else "evaluate"
    name = f"{record.id}-{kind}-r{rnd}-{time.strftime('%Y%m%d-%H%M%S')}"
    outdir = layout.workflow_outputs(name)
    registry.event(record.id, EVENT, f"StreamFlow workflow {name}: round {rnd}'s models "
                   f"({', '.join(plan.models)}) sent to {', '.join(plan.sites)}")
    errors = ErrorLines()
    sf_logger.addHandler(errors)
    started = time.monotonic()
    try:
        with logging_to(layout.evaluate_log):
            asyncio.run(_execute(layout, name, outdir, timeout))
    except asyncio.CancelledError as exc:  # SIGTERM (xffl cancel): its jobs were stopped
        raise RunFailed(f"the evaluation of round {rnd} was stopped (SIGTERM); its jobs "
                        "were cancelled.") from exc
    except TimeoutError as exc:
        raise TimedOut(f"the evaluation of round {rnd} did not finish within {timeout:g} s; "
                       f"its jobs were stopped (see {layout.evaluate_log}).") from exc
    except Exception as exc:  # StepFailed, or StreamFlow's own
        detail = errors.messages[0] if errors.messages else first_line(exc)
        raise RunFailed(f"the evaluation of round {rnd} failed: {detail} "
                        f"(see {layout.evaluate_log})") from exc
    finally:
        sf_logger.removeHandler(errors)
    outcome = Outcome(run_id=record.id, round=rnd, models=plan.models,
                      rows=[site_row(plan, outdir, s) for s in plan.sites],
                      seconds=time.monotonic() - started)
    if not final:
        registry.record_evaluations(record.id, outcome.cells())
    registry.event(record.id, EVENT, f"round {rnd}: {len(outcome.rows) - len(outcome.failed)} "
                   f"of {len(outcome.rows)} sites evaluated {len(plan.models)} models")
    return outcome
