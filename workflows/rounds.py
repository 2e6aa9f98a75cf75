"""One federated round through the per-site plan: train everywhere, retry, time out, aggregate.

Every site's round is its own StreamFlow workflow (see :mod:`xffl.workflows.site_plan`), run
concurrently in one StreamFlow context. A site whose workflow fails (its job, its training
or its submission) is run again up to ``failure.retries`` times; when ``round_timeout``
passes, the sites still training are cancelled (their SLURM jobs scancelled). The updates
that arrived are then verified and aggregated if at least ``failure.min_sites`` are valid
(:func:`xffl.workflows.aggregate_step.aggregate_round`); otherwise the round fails with
every site's reason in the registry.

A round that is re-run after an interruption (``xffl resume``) reuses each site's valid
update of that round if one already arrived, so no finished training is recomputed; the
aggregation itself is deterministic, so re-running it gives the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xffl.aggregator.exchange import MANIFEST_FILE, read_manifest
from xffl.core.errors import first_line
from xffl.jobs.registry import Registry, SiteRound
from xffl.jobs.slurm_view import job_name
from xffl.jobs.spec import JobSpec
from xffl.workflows.aggregate_step import aggregate_round
from xffl.workflows.site_plan import SITES_CONFIG, round_inputs, workflow_name

ATTEMPT_MARK = "xffl: starting"  # streamflow.log: which round and attempt the next step is


def sf_logger() -> Any:
    """StreamFlow's logger (its messages and ours go to the run's streamflow.log)."""
    from streamflow.log_handler import logger

    return logger


class _StepErrors(logging.Handler):
    """Collects the first line of StreamFlow's ERROR messages about one site's train step."""

    def __init__(self, site: str) -> None:
        super().__init__(logging.ERROR)
        self.needle = f"/train_{site}/"
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keep the message if it names the site's step."""
        text = record.getMessage()
        if self.needle in text:
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            self.messages.append(" ".join(lines[:3])[:400])


@dataclass
class SiteOutcome:
    """What one site delivered in one round."""

    site: str
    update: Path | None = None
    attempts: int = 0
    reasons: list[str] = field(default_factory=list)


def round_dir(root: Path, rnd: int) -> Path:
    """rounds/<rnd> of a run directory."""
    return Path(root) / "rounds" / str(rnd)


def delivered_update(root: Path, rnd: int, site: str) -> Path | None:
    """The newest update of ``site`` for round ``rnd`` already on disk, if any."""
    incoming = round_dir(root, rnd) / "incoming" / site
    if not incoming.is_dir():
        return None
    for attempt in sorted(incoming.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        update = attempt / "update"
        if (update / MANIFEST_FILE).is_file():
            try:
                if read_manifest(update).round == rnd:
                    return update
            except Exception:  # a damaged manifest: verification would reject it anyway
                continue
    return None


def _round_config(config: dict[str, Any], run_id: str, sites: list[str],
                  rnd: int) -> dict[str, Any]:
    """streamflow-sites.yml for one round: SLURM job names carry the round number."""
    for site in sites:
        deployment = config["deployments"].get(f"slurm-{site}")
        if deployment is not None:
            deployment["config"]["services"]["train"]["jobName"] = job_name(run_id, site, rnd)
    return config


async def _train_site(context: Any, config: dict[str, Any], root: Path, run_id: str,
                      site: str, rnd: int, model: Path, spec: JobSpec,
                      registry: Registry) -> SiteOutcome:
    """Run one site's workflow, retrying up to failure.retries times."""
    from xffl.workflows.streamflow_run import execute_workflow

    outcome = SiteOutcome(site)
    existing = delivered_update(root, rnd, site)
    if existing is not None:  # its delivery time, marked when it arrived, is kept
        registry.event(run_id, "site", f"round {rnd}: reusing the update {site} delivered")
        outcome.update, outcome.attempts = existing, 1
        return outcome
    policy = spec.failure
    for attempt in range(1, policy.retries + 2):
        outcome.attempts = attempt
        outdir = round_dir(root, rnd) / "incoming" / site / f"a{attempt}"
        shutil.rmtree(outdir, ignore_errors=True)
        outdir.mkdir(parents=True)
        round_inputs(root, site, rnd, model.resolve())
        name = f"{run_id}-r{rnd}-{site}-a{attempt}"
        sf_logger().info(f"{ATTEMPT_MARK} round {rnd} site {site} attempt {attempt}")
        errors = _StepErrors(site)
        sf_logger().addHandler(errors)
        try:
            await execute_workflow(context, config, workflow_name(run_id, site), name, outdir)
            update = outdir / "update"
            if (update / MANIFEST_FILE).is_file():
                outcome.update = update
                registry.mark_delivered(run_id, rnd, site)  # seconds since the round started
                return outcome
            reason = "the job ended without an update"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # StreamFlow raises its own exception types
            # StreamFlow's exception says only "FAILED Workflow execution"; its log says why
            reason = errors.messages[0] if errors.messages else first_line(exc)
        finally:
            sf_logger().removeHandler(errors)
        outcome.reasons.append(f"attempt {attempt}: {reason}")
        registry.event(run_id, "site", f"round {rnd}: {site} attempt {attempt} failed: "
                                       f"{reason}")
        if attempt <= policy.retries and policy.retry_delay:
            await asyncio.sleep(policy.retry_delay)
    return outcome


async def _train_all(root: Path, run_id: str, rnd: int, model: Path, spec: JobSpec,
                     registry: Registry) -> dict[str, SiteOutcome]:
    from xffl.workflows.streamflow_run import load_config, log_to, open_context

    log_to(root / "streamflow.log")
    # StreamFlow's local working files go inside the run directory (same filesystem as
    # rounds/, so updates are moved, not copied)
    tmp = root / "streamflow" / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    sites = [s.name for s in spec.sites]
    context, config = open_context(
        _round_config(load_config(root / SITES_CONFIG), run_id, sites, rnd))
    try:
        tasks = {s: asyncio.create_task(_train_site(context, config, root, run_id, s, rnd,
                                                    model, spec, registry)) for s in sites}
        timeout = spec.failure.round_timeout
        await asyncio.wait(tasks.values(), timeout=timeout)
        outcomes: dict[str, SiteOutcome] = {}
        for site, task in tasks.items():
            if task.done():
                outcomes[site] = task.result()
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            outcomes[site] = SiteOutcome(site, attempts=1, reasons=[
                f"round timeout: still running after {timeout:g} s (failure.round_timeout)"])
        return outcomes
    finally:
        with contextlib.suppress(Exception):
            await context.close()


def _cancel_leftovers(root: Path, run_id: str, outcomes: dict[str, SiteOutcome]) -> None:
    """scancel the jobs of sites that timed out (StreamFlow may leave them queued)."""
    from xffl.jobs.cancel import scancel_site
    from xffl.jobs.slurm_view import slurm_sites

    slurm = slurm_sites(root)
    for site, outcome in outcomes.items():
        if outcome.update is None and site in slurm and any(
                "round timeout" in r for r in outcome.reasons):
            with contextlib.suppress(Exception):
                scancel_site(run_id, site, slurm[site])


def run_round(root: Path, run_id: str, rnd: int, spec: JobSpec, registry: Registry) -> Path:
    """Train round ``rnd`` at every site and aggregate it; return the new global checkpoint.

    Raises QuorumNotMet (after recording the round as failed) when too few sites delivered.
    """
    root = Path(root)
    model = round_dir(root, rnd - 1) / "global"
    registry.start_round(run_id, rnd, [s.name for s in spec.sites])
    started = time.time()
    outcomes = asyncio.run(_train_all(root, run_id, rnd, model, spec, registry))
    _cancel_leftovers(root, run_id, outcomes)
    failed = [SiteRound(site=o.site, state="failed", attempts=o.attempts,
                        reason="; ".join(o.reasons) or "no update")
              for o in outcomes.values() if o.update is None]
    updates = [o.update for o in outcomes.values() if o.update is not None]
    registry.set_round_state(run_id, rnd, "aggregating",
                             f"round {rnd}: {len(updates)} of {len(outcomes)} sites delivered "
                             f"in {time.time() - started:.1f} s; aggregating")
    agg = spec.aggregation
    return aggregate_round(
        run_id, root, registry, rnd, model, updates, strategy=agg.strategy,
        weighting=agg.weighting, params=agg.params, max_shard_size=agg.max_shard_size,
        min_sites=spec.quorum, failed=failed,
        attempts={o.site: o.attempts for o in outcomes.values()},
    )
