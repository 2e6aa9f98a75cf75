"""The admit step of a round: check one site's update on the coordinator as soon as it arrives.

``python -m xffl.workflows.steps.admit --run-dir D --site S --round R --previous G [--update U]``
runs once per site and round (``admit_<site>`` in round.cwl), on the coordinator, right after
StreamFlow has brought the site's update back, so checking overlaps the other sites'
training. The site's name is the coordinator's own (from the plan), never the update's.

It writes ``verdict.json`` (:mod:`xffl.workflows.steps.verdict`): ``completed`` (the update
passed :func:`xffl.aggregator.verify_aggregate.verify_update` against the round's global model
and names this site; it is output as ``update/``), ``rejected`` (with the reason), or
``failed`` (no update came back: the reasons the failure manager recorded). In a registered
run it also records when the update arrived and the SLURM job that trained it. Exit 0 in all
three cases: the aggregate step decides about the round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import (
    CONFIG_FILE,
    MANIFEST_FILE,
    Manifest,
    read_small_file,
)
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.reported import Bounds, hardware_of
from xffl.aggregator.verify import UpdateRejected
from xffl.aggregator.verify_aggregate import round_rules, verify_update
from xffl.core.files import link_files
from xffl.core.layout import RunLayout, registration
from xffl.core.startup import collect_less
from xffl.jobs.registry.attempts import read_attempts
from xffl.jobs.registry.states import SiteState
from xffl.jobs.spec.deadline import StalenessSpec
from xffl.jobs.spec.schema import JobSpec
from xffl.training.slurm_job import RECORD_BYTES, RECORD_FILE
from xffl.workflows.steps.bounds import round_report_bounds
from xffl.workflows.steps.late import read_adopted, read_late
from xffl.workflows.steps.rejected import keep_rejected
from xffl.workflows.steps.tool import step_parser
from xffl.workflows.steps.verdict import VERDICT_FILE, Verdict

SIDE_FILES = {RECORD_FILE: RECORD_BYTES}  # may come back beside the checkpoint


def staleness(rnd: int, started: int, fn: StalenessSpec | None) -> tuple[
        int | None, float | None, str]:
    """An update of a job submitted in round ``started`` taken in round ``rnd``: its rounds
    late, the factor ``fn`` gives it and the line that says so (None, None, "": on time)."""
    if started == rnd:
        return None, None, ""
    tau = rnd - started
    factor = (fn or StalenessSpec()).weight(tau)
    return tau, factor, (f"started in round {started}: {tau} round(s) late, its change "
                         f"applied with staleness weight {factor:.4g}")


def this_round(layout: RunLayout, site: str, started: int, bounds: Bounds | None,
               ) -> Bounds | None:
    """``bounds`` (the plan's: any round's most) tightened to what the job of round
    ``started`` allowed ``site``: under throughput balancing or a round deadline a round's
    steps are the plan's for that round, not ``balance_max`` x the configured ones."""
    if bounds is None:
        return None
    own = round_report_bounds(layout, site, started)
    if own is None:
        return bounds
    tokens, samples = own
    return replace(bounds, max_tokens=tokens if bounds.max_tokens is None else min(
        tokens, bounds.max_tokens), max_samples=samples if bounds.max_samples is None else min(
        samples, bounds.max_samples))


def vocab_size(layout: RunLayout, config: Any) -> int | None:
    """The model's vocabulary from the coordinator's own files: the global's config.json, or
    a LoRA job's base model's (None: neither says)."""
    if not isinstance(config, dict) or "vocab_size" not in config:
        base = layout.base_model / CONFIG_FILE
        try:
            config = json.loads(read_small_file(base)) if base.is_file() else {}
        except (OSError, ValueError):
            config = {}
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    ok = isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 1
    return vocab if ok else None


def admit(layout: RunLayout, site: str, rnd: int, previous: Path, update: Path | None,
          bounds: Bounds | None = None, exchange: ExchangeSpec | None = None,
          freeze_a: bool = False, staleness_fn: StalenessSpec | None = None,
          ) -> tuple[Verdict, Manifest | None]:
    """Judge ``site``'s update of round ``rnd`` against the global ``previous``; with a
    non-plain ``exchange``, its tensors must be in that encoding's dtype; with ``freeze_a``
    (a LoRA adapter's A matrices are frozen), its A tensors must be the global's, bit for bit.

    Every problem with the update, expected or not, is a rejection of this site's update
    with its reason: one bad update never stops a round that has its quorum. An update of a
    late job this round adopted (:mod:`xffl.workflows.steps.late`) is checked against the
    global its job started from and carries its staleness (``staleness_fn``); a site with no
    update whose job was left running at the deadline is ``late``.
    """
    record = read_attempts(layout, rnd, site)
    attempts = record.attempts if record is not None else 1
    if update is None:
        late = read_late(layout, site)
        if late is not None and (record is None or record.timed_out):
            return Verdict(site=site, round=rnd, state=SiteState.LATE, attempts=attempts,
                           late_job_id=late.job_id, reason=f"SLURM job {late.job_id} (round "
                           f"{late.round}) left running at the round deadline"), None
        reason = record.reason if record is not None and record.failures else (
            "no update came back")
        return Verdict(site=site, round=rnd, state=SiteState.FAILED, reason=reason,
                       attempts=attempts), None
    arrived = time.time()
    adopted = read_adopted(layout, rnd, site)
    started = rnd if adopted is None else adopted.round
    if started != rnd:  # a late job's update: checked against the global it started from
        previous = layout.global_dir(started - 1)
    bounds = this_round(layout, site, started, bounds)
    rules = round_rules(previous, exchange=exchange, round=started, freeze_a=freeze_a)
    vocab = vocab_size(layout, rules.config)
    if bounds is not None and vocab is not None:
        bounds = replace(bounds, vocab_size=vocab)  # a validation loss's bound
    rules = replace(rules, bounds=bounds or Bounds(side_files=SIDE_FILES))
    try:
        manifest = verify_update(rules, update, site)
    except UpdateRejected as exc:
        return Verdict(site=site, round=rnd, state=SiteState.REJECTED, reason=exc.reason,
                       attempts=attempts, delivered_at=arrived), None
    except Exception as exc:  # whatever a crafted update makes a check raise
        return Verdict(site=site, round=rnd, state=SiteState.REJECTED, attempts=attempts,
                       reason=f"could not be checked ({type(exc).__name__}: "
                       f"{str(exc)[:200]})", delivered_at=arrived), None
    metrics = manifest.metrics
    val_samples, val_tokens = metrics.get(metric.VAL_SAMPLES), metrics.get(metric.VAL_TOKENS)
    stale = staleness(rnd, started, staleness_fn)
    return Verdict(site=site, round=rnd, state=SiteState.COMPLETED, attempts=attempts,
                   staleness=stale[0], staleness_weight=stale[1], reason=stale[2],
                   num_samples=manifest.num_samples, num_tokens=manifest.num_tokens,
                   loss=metrics.get(metric.LOSS), train_seconds=metrics.get(metric.TRAIN_SECONDS),
                   startup_seconds=metrics.get(metric.STARTUP_SECONDS),
                   val_loss=metrics.get(metric.VAL_LOSS),
                   val_loss_update=metrics.get(metric.VAL_LOSS_UPDATE),
                   val_samples=None if val_samples is None else int(val_samples),
                   val_tokens=None if val_tokens is None else int(val_tokens),
                   delivered_at=arrived, digest=manifest.digest(),
                   **hardware_of(manifest)), manifest


def _record(layout: RunLayout, verdict: Verdict, update: Path | None) -> None:
    """In a registered run: when the update arrived, and the SLURM job that trained it.

    What the site sent cannot stop the round from here: a record the registry cannot take
    is left out, with a line on stderr.
    """
    try:
        _record_delivery(layout, verdict, update)
    except Exception as exc:  # the update's slurm_job.json is the site's text
        print(f"round {verdict.round}: site {verdict.site}: delivery not recorded "
              f"({type(exc).__name__}: {str(exc)[:200]})", file=sys.stderr)


def _record_delivery(layout: RunLayout, verdict: Verdict, update: Path | None) -> None:
    reg = registration(layout)
    if reg is None or update is None or verdict.delivered_at is None:
        return
    from xffl.jobs.registry.store import Registry
    from xffl.jobs.slurm_view import record_delivered

    registry = Registry(reg.registry)
    registry.mark_delivered(reg.run_id, verdict.round, verdict.site, at=verdict.delivered_at)
    record_delivered(registry, reg.run_id, verdict.round, verdict.site, update)
    what = f"update {verdict.digest[:12]}" if verdict.digest else "update"
    registry.event(reg.run_id, "admit", f"round {verdict.round}: {verdict.site} {what} "
                   f"{'admitted' if verdict.accepted else 'rejected: ' + verdict.reason}")


def run_step(args: argparse.Namespace) -> int:
    """Admit one update; write verdict.json and cwl.output.json in the working directory."""
    layout = RunLayout(Path(args.run_dir))
    update = Path(args.update) if args.update else None
    bounds = Bounds(max_tokens=args.max_tokens, max_samples=args.max_samples,
                    side_files=SIDE_FILES, max_val_samples=args.max_val_samples,
                    val_seq_len=args.val_seq_len)
    spec = JobSpec.of_run(layout.root)  # the exchange and LoRA rules every update follows
    verdict, manifest = admit(layout, args.site, args.round, Path(args.previous), update,
                              bounds, spec.exchange, spec.freeze_a,
                              spec.round_deadline.staleness if spec.round_deadline else None)
    _record(layout, verdict, update)
    if update is not None and verdict.state == SiteState.REJECTED:
        try:  # a rejected copy from a site is kept a while, within caps, then removed
            keep_rejected(layout, args.round, args.site, update, Path(args.previous))
        except OSError as exc:
            print(f"round {args.round}: site {args.site}: the rejected update was not "
                  f"moved ({exc})", file=sys.stderr)
    out: dict[str, Any] = {"update": None}
    if manifest is not None and update is not None:
        kept = [MANIFEST_FILE, *manifest.files]  # files of the global's kind (admission)
        if (update / RECORD_FILE).is_file() and RECORD_FILE not in kept:
            kept.append(RECORD_FILE)
        link_files(update, Path.cwd() / "update", kept)
        out["update"] = {"class": "Directory", "path": str(Path.cwd() / "update")}
    verdict.write(Path.cwd() / VERDICT_FILE)
    out["verdict"] = {"class": "File", "path": str(Path.cwd() / VERDICT_FILE)}
    Path("cwl.output.json").write_text(json.dumps(out))
    line = f"round {verdict.round}: site {verdict.site} {verdict.state}"
    print(line + (f": {verdict.reason}" if verdict.reason else ""), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the plan's admit tool."""
    collect_less()  # before the imports it makes (see xffl.core.startup)
    parser = step_parser("xffl.workflows.steps.admit")
    parser.add_argument("--site", required=True)
    parser.add_argument("--previous", required=True, help="the round's global model")
    parser.add_argument("--update", default=None, help="the site's update (absent: none came)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="the most tokens the site's job can have trained on")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="the most samples the site may report")
    parser.add_argument("--max-val-samples", type=int, default=None,
                        help="the most held-out sequences the site evaluates (none: the site "
                        "has no validation data and may report no validation numbers)")
    parser.add_argument("--val-seq-len", type=int, default=None,
                        help="the targets one held-out sequence holds (the job's seq_len): "
                        "val_tokens is at most val_samples times this")
    return run_step(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
