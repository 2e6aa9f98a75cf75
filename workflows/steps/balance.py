"""Heterogeneous facilities finishing together: round budgets from last round's throughput.

With ``training.balance: throughput`` every round after the first gives each site the
number of steps it can run in the time the slowest site needs for its own budget, measured
from the updates of the previous round (their ``train_seconds`` and ``steps`` metrics):

    T = max over sites of configured_steps(s) x seconds_per_step(s)
    steps(s) = clamp(floor(T / seconds_per_step(s)), configured_steps(s),
                     balance_max x configured_steps(s))

so fast facilities train more instead of idling while the slow one finishes (their GPUs
are allocated for the round anyway). A site with a time budget, or without an update in the
previous round, keeps its configured budget. The round's job files are written to
``rounds/<r>/jobs/<site>.json``; ``jobs/<site>.json`` keeps the configured ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xffl.jobs.report.estimates import per_step_seconds
from xffl.training.config import TrainJob, round_steps


def configured_job(root: Path, site: str) -> TrainJob:
    """The site's TrainJob as planned (its own budget applied)."""
    return TrainJob.model_validate_json((root / "jobs" / f"{site}.json").read_text())


def balanced_steps(root: Path, rnd: int, sites: list[str]) -> dict[str, int]:
    """Each balanced site's steps for round ``rnd`` (sites left out keep their budget)."""
    jobs = {s: configured_job(root, s) for s in sites}
    speed = {s: per_step_seconds(root, rnd - 1, s) for s in sites}
    planned = {s: round_steps(j.training, 1) for s, j in jobs.items()}  # dp 1: a lower bound
    timed = [planned[s] * v for s, v in speed.items() if v is not None]
    if rnd < 2 or not timed:
        return {}
    target = max(timed)
    out = {}
    for site, job in jobs.items():
        per_step = speed[site]
        if job.training.balance != "throughput" or job.training.time_budget is not None \
                or per_step is None:
            continue
        cap = math.floor(planned[site] * job.training.balance_max)
        # min in floats first: a tiny per-step time makes target / per_step inf
        out[site] = max(planned[site], math.floor(min(float(cap), target / per_step)))
    return out


def write_round_job(root: Path, site: str, rnd: int, job: TrainJob, steps: int) -> str:
    """Write ``job`` with ``steps`` per round as the site's job file of round ``rnd``;
    return its path relative to the run directory."""
    sized = job.model_copy(update={"training": job.training.model_copy(
        update={"steps": steps, "tokens": None})})
    path = root / "rounds" / str(rnd) / "jobs" / f"{site}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sized.model_dump(mode="json"), indent=2) + "\n")
    return str(path.relative_to(root))


def round_job(root: Path, site: str, rnd: int, sites: list[str]) -> str:
    """The job file of ``site`` in round ``rnd``, relative to the run directory."""
    job = configured_job(root, site)
    if job.training.balance != "throughput" or rnd < 2:
        return f"jobs/{site}.json"
    steps = balanced_steps(root, rnd, sites).get(site)
    if steps is None:
        return f"jobs/{site}.json"
    return write_round_job(root, site, rnd, job, steps)
