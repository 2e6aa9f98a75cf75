"""The final model's held-out loss: after the last round every site evaluates the final global.

Every round measures the global model it starts from, so the last round's global is
measured by no round. As Flower's final evaluation after its last round, the supervisor then
runs the cross-site evaluation of ``xffl evaluate`` (:mod:`xffl.workflows.evaluate_run`: one
StreamFlow workflow, a step per site on the deployment the site trains on, only numbers
coming back) with the final global alone, and combines the sites' losses as every round's
validation is combined (:func:`xffl.workflows.steps.early_stop.combine`): the mean over all
the sites' held-out targets in the loss, and the median across the sites' own losses. It is
written to ``final-validation.json`` in the run directory and recorded in the registry, where
``xffl status`` and ``xffl report`` read it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from xffl.core.errors import first_line
from xffl.core.files import write_json
from xffl.core.layout import RunLayout
from xffl.jobs.records import FinalLoss, RunRecord
from xffl.jobs.registry import Registry
from xffl.jobs.report import GLOBAL
from xffl.jobs.spec import JobSpec
from xffl.jobs.states import RunState
from xffl.workflows.evaluate_run import Outcome, evaluate_run
from xffl.workflows.steps.early_stop import combine

EVENT = "final evaluation"
TIMEOUT_S = 3600.0  # without failure.round_timeout, as `xffl evaluate`'s default


def final_loss(outcome: Outcome) -> FinalLoss | None:
    """The federated loss of the evaluated global from the sites' rows (None: no site sent
    a loss over a target)."""
    fed = combine(outcome.round, [(r.site, r.result.losses[GLOBAL], r.result.samples,
                                   r.result.tokens) for r in outcome.rows
                                  if r.result is not None])
    if fed is None or fed.val_loss_median is None:
        return None
    return FinalLoss(round=outcome.round, val_loss=fed.val_loss,
                     val_loss_median=fed.val_loss_median, val_samples=fed.val_samples,
                     val_tokens=fed.val_tokens, sites=fed.sites, site_tokens=fed.site_tokens)


def evaluate_final(registry: Registry, record: RunRecord,
                   timeout: float) -> tuple[FinalLoss | None, Outcome]:
    """Evaluate the run's last global at every site; record and return its federated loss."""
    outcome = evaluate_run(registry, record, record.rounds_done, timeout, final=True)
    final = final_loss(outcome)
    if final is not None:
        write_json(RunLayout(Path(record.run_dir)).final_validation, asdict(final))
        registry.record_final(record.id, final)
    return final, outcome


def skipped(spec: JobSpec) -> str | None:
    """Why a run's final model is not evaluated, or None when it is."""
    if spec.training.lora is not None:
        return "a LoRA adapter, which the evaluation does not load"
    if any(s.data.validation is None for s in spec.sites):
        return "not every site has held-out data (data.validation)"
    return None


def after_last_round(registry: Registry, record: RunRecord, spec: JobSpec, done: str) -> str:
    """Evaluate the final global of a run whose rounds are ``done`` (the completion message);
    return that message, with why the final loss is missing or partial where it is."""
    why = skipped(spec)
    if why is not None:
        registry.event(record.id, EVENT, f"not run: the final model is {why}")
        return done
    registry.set_state(record.id, RunState.RUNNING, f"{done}; evaluating the final global "
                       "model on every site's held-out data")
    timeout = spec.failure.round_timeout or TIMEOUT_S
    try:
        final, outcome = evaluate_final(registry, record, timeout)
    except Exception as exc:  # the rounds are done whatever happens here: say it, go on
        note = f"the final model's held-out loss was not measured: {first_line(exc)}"
        registry.event(record.id, EVENT, note)
        return f"{done}; {note}"
    failed = "; ".join(f"site {r.site}: {r.error}" for r in outcome.failed)
    if final is None:
        note = "the final model's held-out loss was not measured" + (
            f" ({failed})" if failed else ": no site's held-out data has a target")
    else:
        note = f"the final model's held-out loss is {final.val_loss:.4f}" + (
            f", without {failed}" if failed else "")
    registry.event(record.id, EVENT, note)
    return f"{done}; {note}" if failed or final is None else done
