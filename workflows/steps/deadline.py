"""Round budgets that fit a deadline: each site's steps from its queue, start-up and speed.

With ``round_deadline: {seconds: D}`` every round after the first gives site ``s`` the
steps its update is expected to need to be in by ``D`` seconds after the round's start,
from its estimates (:mod:`xffl.jobs.report.estimates`: queue wait ``q``, start-up ``u``, seconds
per step ``p``, exponentially weighted over its delivered rounds):

    steps(s) = clamp(floor((D - q(s) - u(s)) / p(s)), min_steps, max_steps(s))

With ``late: adopt`` a site that cannot make the deadline (``q + u + min_steps p > D``)
fits the first deadline it can make, ``k D`` with ``k = ceil((q + u + min_steps p) / D)``,
in place of ``D``: a later round adopts its update anyway.
``max_steps(s)`` defaults to the site's configured steps x ``training.balance_max``, and
``u(s)`` to the site's ``startup`` (else ``round_deadline.startup``) until one is measured.
A site whose speed is not measured yet trains its configured steps, within the same bounds.
The job files are written as :mod:`xffl.workflows.steps.balance` writes them
(``rounds/<r>/jobs/<site>.json``), and replace throughput balancing when both are asked.

The learning rate per step is left as configured: a site that trains ``K`` steps moves the
model about ``K`` times as far as one step, and the aggregate weighs it by the samples it
trained (``K`` x its batch), so the round's effective step grows with the weighted mean of
the sites' ``K``; ``[min_steps, max_steps]`` bound that to ``max_steps / min_steps`` times
the configured plan's.
"""

from __future__ import annotations

import math
from pathlib import Path

from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import SiteEstimate, site_estimates
from xffl.jobs.spec.deadline import RoundDeadline
from xffl.jobs.spec.schema import JobSpec
from xffl.training.config import TrainJob, round_steps
from xffl.workflows.steps.balance import configured_job, write_round_job


def most_steps(deadline: RoundDeadline, planned: int, balance_max: float) -> int:
    """The most steps a site's round may have under the deadline (``planned``: configured)."""
    return deadline.max_steps or max(deadline.min_steps, math.floor(planned * balance_max))


def fit_steps(deadline: RoundDeadline, planned: int, balance_max: float,
              estimate: SiteEstimate, startup: float) -> int:
    """One site's steps for the next round (``planned``: its configured steps)."""
    high = most_steps(deadline, planned, balance_max)
    per_step = estimate.seconds_per_step
    if per_step is None:
        return max(deadline.min_steps, min(high, planned))
    before = (estimate.queue_wait_s or 0.0) + (
        estimate.startup_s if estimate.startup_s is not None else startup)
    left = deadline.seconds - before
    if deadline.late == "adopt" and left < deadline.min_steps * per_step:
        # it cannot make this deadline: its update is adopted by a later round, so fit it to
        # the first deadline it can make (k rounds of `seconds` from its submission)
        k = math.ceil((before + deadline.min_steps * per_step) / deadline.seconds)
        left = k * deadline.seconds - before
    fit = math.floor(min(float(high), max(0.0, left) / per_step))  # min first: never inf
    return max(deadline.min_steps, min(high, fit))


def deadline_steps(spec: JobSpec, jobs: dict[str, TrainJob],
                   estimates: dict[str, SiteEstimate]) -> dict[str, int]:
    """Every site's steps for the next round under ``spec.round_deadline`` (sites with a time
    budget keep it, and are left out)."""
    deadline = spec.round_deadline
    if deadline is None:
        return {}
    out = {}
    for site in spec.sites:
        job = jobs[site.name]
        if job.training.time_budget is not None:
            continue
        startup = site.startup if site.startup is not None else deadline.startup
        estimate = estimates.get(site.name, SiteEstimate(site.name))
        out[site.name] = fit_steps(deadline, round_steps(job.training, 1),
                                   job.training.balance_max, estimate, startup)
    return out


def deadline_jobs(root: Path, rnd: int, spec: JobSpec, registry: Registry,
                  run_id: str) -> dict[str, str]:
    """Each site's job file for round ``rnd``, relative to the run directory, fit to the
    deadline from what the registry recorded of the run so far."""
    jobs = {s.name: configured_job(root, s.name) for s in spec.sites}
    estimates = {e.site: e for e in site_estimates(registry, registry.get_run(run_id))}
    steps = deadline_steps(spec, jobs, estimates)
    return {site: write_round_job(root, site, rnd, jobs[site], steps[site]) if site in steps
            else f"jobs/{site}.json" for site in jobs}
