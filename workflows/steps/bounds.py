"""What a site's update may report in a round: the plan's bounds, and one round's own.

The plan passes each site's admit step the most tokens and samples any of its rounds may
report (:func:`report_bounds`); under throughput balancing or a round deadline that is the
most steps a round may be given (``training.balance_max`` x the configured steps, or the
deadline's ``max_steps``). The admit step tightens them to the steps the job of the update's
own round gave the site (:func:`round_report_bounds`, from ``rounds/<r>/jobs/<site>.json``),
so a site cannot claim a balanced round's maximum in every round.
"""

from __future__ import annotations

import math

from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec, SiteSpec
from xffl.training.config import TrainJob, round_steps


def report_bounds(spec: JobSpec, site: SiteSpec, steps: int | None = None) -> tuple[
        int | None, int | None, int | None, int | None]:
    """The most tokens, samples and held-out sequences ``site``'s update may report in a round,
    and the targets one held-out sequence holds (None: unbounded; for the last two: the site
    has no validation data).

    Tokens: steps x batch x accumulation x sequence length x ranks, steps as many as the
    budget allows (a token budget with one data-parallel rank, the most steps), times
    ``balance_max`` when throughput balancing may raise them, or a round deadline's most
    steps; ``steps``: one round's own steps instead (what its job gave the site). Samples:
    the dataset size the job declares (``data.max_samples``, a synthetic corpus's size), or
    the samples of the round's steps if more; with real data and no declared size, the
    samples of the round's steps (what the site's trainer then reports): a site's weight is
    never unbounded. Held-out sequences: the job's evaluation budget, each of ``seq_len``
    targets (the held-out targets in the loss, ``val_tokens``, are at most their product).
    """
    training = site.budget.apply(spec.training) if site.budget else spec.training
    planned = most = round_steps(training, 1)
    if steps is not None:
        most = steps
    else:
        if training.balance == "throughput":
            most = math.floor(planned * training.balance_max)
        if spec.round_deadline is not None:
            from xffl.workflows.steps.deadline import most_steps

            most = max(most, most_steps(spec.round_deadline, planned, training.balance_max))
    samples = most * training.batch_size * training.grad_accum * site.ranks
    declared = site.data.declared_samples
    held_out = spec.evaluation.sequences(training) if site.data.validation else None
    return (samples * training.seq_len, samples if declared is None else max(declared, samples),
            held_out, None if held_out is None else training.seq_len)


def round_report_bounds(layout: RunLayout, site: str, rnd: int) -> tuple[int, int] | None:
    """The most tokens and samples ``site``'s update of a job started in round ``rnd`` may
    report: its round's job file (``rounds/<rnd>/jobs/<site>.json`` when balancing or a
    deadline wrote one, else the configured ``jobs/<site>.json``). None: the run directory
    holds no job spec (an admit outside a run)."""
    if not layout.job_json.is_file():
        return None
    spec = JobSpec.of_run(layout.root)
    found = [s for s in spec.sites if s.name == site]
    if not found:
        return None
    path = layout.round_job(rnd, site)
    if not path.is_file():
        path = layout.job_file(site)
    job = TrainJob.model_validate_json(path.read_text())
    tokens, samples, *_ = report_bounds(spec, found[0], round_steps(job.training, 1))
    assert tokens is not None and samples is not None  # always, with steps given
    return tokens, samples
