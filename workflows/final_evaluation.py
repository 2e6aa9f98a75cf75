"""The final model's held-out loss by hand: ``xffl evaluate RUN --final``.

A run evaluates its final global itself, as steps of its plan (main.cwl's
``final_evaluate_<site>`` and ``final_validation``, :mod:`xffl.workflows.steps.final_validation`).
When a site's part of that failed, or the run predates it, ``xffl evaluate --final`` runs the
cross-site evaluation of ``xffl evaluate`` (:mod:`xffl.workflows.evaluate_run`: one StreamFlow
workflow, a step per site on the deployment the site trains on, only numbers coming back)
with the last global alone, and combines the sites' losses as the plan's step does. It is
written to ``final-validation.json`` in the run directory and recorded in the registry.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from xffl.core.files import write_json
from xffl.core.layout import RunLayout
from xffl.jobs.registry.records import FinalLoss, RunRecord
from xffl.jobs.registry.store import Registry
from xffl.workflows.evaluate_run import Outcome, evaluate_run
from xffl.workflows.steps.final_validation import final_of


def final_loss(outcome: Outcome) -> FinalLoss | None:
    """The federated loss of the evaluated global from the sites' rows (None: no site sent
    a loss over a target)."""
    return final_of(outcome.round, [r.result for r in outcome.rows if r.result is not None])


def evaluate_final(registry: Registry, record: RunRecord,
                   timeout: float) -> tuple[FinalLoss | None, Outcome]:
    """Evaluate the run's last global at every site; record and return its federated loss."""
    outcome = evaluate_run(registry, record, record.rounds_done, timeout, final=True)
    final = final_loss(outcome)
    if final is not None:
        write_json(RunLayout(Path(record.run_dir)).final_validation, asdict(final))
        registry.record_final(record.id, final)
    return final, outcome
