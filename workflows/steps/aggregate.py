"""The aggregate step of a round, run by the plan on the coordinator.

``python -m xffl.workflows.steps.aggregate --run-dir D --sites a,b --round R --max-rounds M
--previous G --verdict=a=V --update=a=U --job=a=J ...`` takes every site's verdict (from its
admit step), aggregates the admitted updates tensor by tensor into ``rounds/<r>/global``
(atomically) when at least the job's quorum were admitted, keeps them in
``rounds/<r>/updates/<site>`` under the coordinator's names, and answers the loop through
``cwl.output.json``: the new model, the next round, ``go`` (and, when the plan evaluates the
final model, ``last_round`` and ``over``: whether the run ends here), and each site's job file
for the next round (balanced by throughput when the job asks for it), so the CWL needs no
JavaScript. What the job asks of aggregation (strategy, weighting, parameters, shard size,
quorum, influence bounds, exchange, early stop) it reads from the run's ``job.json``, the
job spec as resolved when the plan was written: one source, not command-line options. In a
registered run (``run.json``) it records the round in the registry. Too few admitted updates:
the round is recorded as failed, with every site's reason, and the step exits 1, which ends
the workflow.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.metrics import LOSS
from xffl.aggregator.verify_aggregate import Aggregation, round_rules, verify_and_aggregate
from xffl.core.failpoints import failpoint
from xffl.core.files import link_files
from xffl.core.layout import RunLayout, registration
from xffl.core.resources import peak_rss_bytes
from xffl.core.startup import collect_less
from xffl.jobs.registry.records import RoundRecord
from xffl.jobs.registry.states import RoundState
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps.balance import round_job
from xffl.workflows.steps.deadline import deadline_jobs
from xffl.workflows.steps.early_stop import (
    Stopped,
    federated,
    history,
    read_stopped,
    stop_reason,
    write_stopped,
)
from xffl.workflows.steps.final_validation import skipped
from xffl.workflows.steps.tool import step_parser
from xffl.workflows.steps.verdict import Verdict, read_verdict

QUORUM_EXIT = 1
QUORUM_EVENT = "quorum"  # the registry event the supervisor reports a failed round with


class QuorumNotMet(RuntimeError):
    """Fewer admitted updates than the job's ``failure.min_sites``: the round cannot aggregate."""


def _per_site(pairs: Sequence[str], option: str, sites: list[str]) -> dict[str, Path]:
    """``SITE=PATH`` options as {site: path}, for the plan's own sites only."""
    out: dict[str, Path] = {}
    for pair in pairs:
        site, sep, path = pair.partition("=")
        if not sep or site not in sites or site in out:
            raise SystemExit(f"{option}: {pair!r} is not SITE=PATH for a site of {sites}")
        out[site] = Path(path)
    return out


def quorum_message(rnd: int, verdicts: list[Verdict], min_sites: int) -> str:
    """The sentence a round that cannot aggregate ends with."""
    admitted = sum(v.accepted for v in verdicts)
    lost = "; ".join(f"{v.site}: {v.reason or v.state}" for v in verdicts if not v.accepted)
    return (f"round {rnd}: {admitted} valid update(s), the job needs {min_sites} "
            f"(failure.min_sites) ({lost or 'no update'})")


def aggregation_of(spec: JobSpec) -> Aggregation:
    """How the job aggregates its rounds (its ``aggregation`` section)."""
    agg = spec.aggregation
    return Aggregation(agg.strategy, agg.weighting, dict(agg.params), agg.max_shard_size,
                       agg.clip_norm, agg.max_weight_share)


def aggregate_round(layout: RunLayout, rnd: int, previous: Path, verdicts: list[Verdict],
                    updates: dict[str, Path], spec: JobSpec,
                    registry: tuple[Registry, str] | None) -> Path:
    """Aggregate the admitted updates into rounds/<rnd>/global as ``spec`` asks; record the
    round."""
    if sum(v.accepted for v in verdicts) < spec.quorum:
        message = quorum_message(rnd, verdicts, spec.quorum)
        if registry is not None:
            reg, run_id = registry
            reg.finish_round(run_id, RoundRecord(
                round=rnd, state=RoundState.FAILED, ended=time.time(),
                sites=[v.site_round() for v in verdicts]))
            reg.event(run_id, QUORUM_EVENT, message)
        raise QuorumNotMet(message)
    admitted = sorted(v.site for v in verdicts if v.accepted)
    # of the global this round started from (a late update measured an older one)
    validation = federated(rnd, [v for v in verdicts if v.staleness is None])
    if validation is not None:
        validation.write(layout.validation_file(rnd))
    target = layout.global_dir(rnd)
    t0 = time.perf_counter()
    inputs = applied_updates(layout, rnd, previous, verdicts, updates)
    # each update was verified by its admit step (verify_update) as it arrived
    verify_and_aggregate(round_rules(previous, exchange=spec.exchange, round=rnd),
                         aggregation_of(spec), [inputs[s] for s in admitted], target,
                         verified=True)
    seconds = time.perf_counter() - t0
    failpoint(f"aggregated-round-{rnd}")  # the global is on disk, the registry not updated
    for site in admitted:  # keep what was aggregated beside the result, under our names
        kept = layout.kept_update(rnd, site)
        if not kept.exists():
            link_files(updates[site], kept, sorted(p.name for p in updates[site].iterdir()))
    manifest = read_manifest(target)
    if registry is not None:
        reg, run_id = registry
        reg.event(run_id, "resources", f"round {rnd}: aggregate step peak RSS "
                  f"{peak_rss_bytes() / 2**20:.0f} MiB")
        reg.finish_round(run_id, RoundRecord(
            round=rnd, state=RoundState.COMPLETED, ended=time.time(), aggregate_seconds=seconds,
            global_path=str(target), global_digest=manifest.digest(),
            num_samples=manifest.num_samples, loss=manifest.metrics.get(LOSS),
            val_loss=validation.val_loss if validation else None,
            val_samples=validation.val_samples if validation else None,
            val_tokens=validation.val_tokens if validation else None,
            sites=[v.site_round() for v in verdicts]))
        track(spec, reg, run_id, rnd)
        failpoint(f"recorded-round-{rnd}")  # the round is on record, the loop not answered
    print(f"round {rnd}: aggregated {len(admitted)} updates ({', '.join(admitted)}) in "
          f"{seconds:.2f} s", file=sys.stderr)
    return target


def applied_updates(layout: RunLayout, rnd: int, previous: Path, verdicts: list[Verdict],
                    updates: dict[str, Path]) -> dict[str, Path]:
    """The admitted updates as the strategy takes them: a late one as its change from the
    global it started from, times its staleness weight, on ``previous``
    (:func:`xffl.aggregator.rebase.rebase`, kept in ``rounds/<r>/rebased/<site>``)."""
    out = dict(updates)
    for v in verdicts:
        if v.accepted and v.staleness is not None and v.staleness_weight is not None:
            from xffl.aggregator.rebase import rebase

            rebased = layout.round_dir(rnd) / "rebased" / v.site
            rebase(updates[v.site], layout.global_dir(rnd - v.staleness - 1), previous,
                   v.staleness_weight, rebased, rnd)
            out[v.site] = rebased
    return out


def track(spec: JobSpec, reg: Registry, run_id: str, rnd: int) -> None:
    """Log the round just recorded to the job's experiment trackers (``tracking``), from the
    registry; a tracker that fails leaves a ``tracking`` event, never a failed round."""
    if spec.tracking is None:
        return
    from xffl.jobs.tracking.rounds import log_round  # the trackers' modules, only when used

    record = next(r for r in reg.rounds(run_id) if r.round == rnd)
    warnings = log_round(spec.tracking, reg.get_run(run_id), spec.model_dump(mode="json"),
                         record, reg.transfers(run_id))
    for warning in warnings:
        reg.event(run_id, "tracking", warning)


def next_jobs(layout: RunLayout, rnd: int, jobs: dict[str, Path], sites: list[str],
              here: Path, fitted: dict[str, str] | None = None) -> dict[str, Path]:
    """Each site's job file for round ``rnd + 1``, as outputs in ``here``.

    ``fitted`` (fit to a round deadline, :mod:`xffl.workflows.steps.deadline`), else the
    configured job, or the one balanced by the sites' throughput in round ``rnd``
    (``training.balance``, :mod:`xffl.workflows.steps.balance`).
    """
    out: dict[str, Path] = {}
    for site in sites:
        chosen = layout.root / (fitted[site] if fitted and site in fitted
                                else round_job(layout.root, site, rnd + 1, sites))
        if chosen == layout.job_file(site):
            chosen = jobs[site]  # as the round was given it
        dst = here / "jobs" / f"{site}.json"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(chosen, dst)
        out[site] = dst
    return out


def run_step(args: argparse.Namespace) -> int:
    """Aggregate one round as round.cwl's aggregate step; return the process exit code."""
    layout = RunLayout(Path(args.run_dir))
    sites = [s for s in args.sites.split(",") if s]
    verdict_files = _per_site(args.verdict, "--verdict", sites)
    updates = _per_site(args.update, "--update", sites)
    jobs = _per_site(args.job, "--job", sites)
    verdicts = [read_verdict(verdict_files[s]) for s in sites]
    for v in verdicts:  # an update without an admitted verdict is never aggregated
        if v.accepted and v.site not in updates:
            raise SystemExit(f"--update: no update for admitted site {v.site!r}")
    reg = registration(layout)
    registry = (Registry(reg.registry), reg.run_id) if reg is not None else None
    rnd: int = args.round
    spec = JobSpec.of_run(layout.root)
    try:
        target = aggregate_round(layout, rnd, Path(args.previous), verdicts, updates, spec,
                                 registry)
    except QuorumNotMet as exc:
        print(str(exc), file=sys.stderr)
        return QUORUM_EXIT
    here = Path.cwd()
    link_files(target, here / "global", sorted(p.name for p in target.iterdir()))
    go = rnd < args.max_rounds
    stop = spec.training.stop_when
    if go and stop is not None:
        reason = stop_reason(history(layout, rnd), stop.patience, stop.min_delta)
        if reason is not None:
            write_stopped(layout, Stopped(round=rnd, reason=reason))
            if registry is not None:
                registry[0].event(registry[1], "stop", f"after round {rnd}: {reason}")
            print(f"round {rnd}: {reason}", file=sys.stderr)
            go = False
    if go and registry is not None:
        registry[0].start_round(registry[1], rnd + 1, sites)
    out: dict[str, Any] = {"model": {"class": "Directory", "path": str(here / "global")},
                           "next_round": rnd + 1, "go": go}
    if skipped(spec) is None:  # the plan evaluates the final model once the run is over
        out.update(last_round=rnd, over=not go and (rnd >= spec.rounds
                                                   or read_stopped(layout) is not None))
    fitted = None
    if go and spec.round_deadline is not None and registry is not None:
        fitted = deadline_jobs(layout.root, rnd + 1, spec, *registry)
    for site, path in next_jobs(layout, rnd, jobs, sites, here, fitted).items():
        out[f"job_{site}"] = {"class": "File", "path": str(path)}
    (here / "cwl.output.json").write_text(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the plan's aggregate tool."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    parser = step_parser("xffl.workflows.steps.aggregate")
    parser.add_argument("--sites", required=True, help="the plan's sites, comma-separated")
    parser.add_argument("--max-rounds", type=int, required=True)
    parser.add_argument("--previous", required=True)
    for name in ("update", "verdict", "job"):
        parser.add_argument(f"--{name}", action="append", default=[], help="SITE=PATH")
    return run_step(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

