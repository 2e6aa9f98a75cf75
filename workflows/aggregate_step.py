"""The aggregate step of a round, run by the plan on the coordinator.

It verifies the site updates against the previous global model, aggregates the accepted ones
tensor by tensor into ``<run_dir>/rounds/<r>/global`` (atomically), records the round in the
registry, and answers the loop through ``cwl.output.json`` (model, next_round, go), so the
CWL needs no JavaScript engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.shards import DEFAULT_MAX_SHARD_SIZE
from xffl.aggregator.strategies import parse_pairs, run_strategy
from xffl.aggregator.verify import select_updates
from xffl.core.failpoints import failpoint
from xffl.jobs.registry import Registry, RoundRecord, SiteRound
from xffl.jobs.slurm_view import record_delivered


def _link_tree(src: Path, dst: Path) -> None:
    """Expose ``src`` as ``dst`` (the step's output) by hardlinks, falling back to copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        try:
            os.link(item, dst / item.name)
        except OSError:
            shutil.copy2(item, dst / item.name)


class QuorumNotMet(RuntimeError):
    """Fewer valid updates than the job's ``failure.min_sites``: the round cannot aggregate."""


def aggregate_round(
    run_id: str, run_dir: Path, registry: Registry, rnd: int, previous_dir: Path,
    updates: list[Path], *, strategy: str = "fedavg", weighting: str = "samples",
    params: dict[str, float] | None = None, max_shard_size: str | int | None = None,
    min_sites: int = 1, failed: list[SiteRound] | None = None,
    attempts: dict[str, int] | None = None,
) -> Path:
    """Verify ``updates``, aggregate the valid ones into rounds/<rnd>/global, record the round.

    ``failed`` are sites that delivered nothing (with their reasons), recorded beside the
    verified ones. Raises QuorumNotMet, after recording the round as failed, when fewer
    than ``min_sites`` updates are valid. Returns the new global checkpoint's directory.
    """
    attempts = attempts or {}
    previous = verify_checkpoint(previous_dir)
    accepted, rejected = select_updates(
        updates, expected_round=rnd, expected_parent=previous.digest(),
        reference_index=previous.tensors,
    )
    for update_dir, site in [(d, m.site or "?") for d, m in accepted] + [
            (d, site) for d, site, _ in rejected]:  # the SLURM job that trained each update
        record_delivered(registry, run_id, rnd, site, update_dir)
    sites: list[SiteRound] = list(failed or [])
    for _, site, reason in rejected:
        print(f"rejected update from {site}: {reason}", file=sys.stderr)
        sites.append(SiteRound(site=site, state="rejected", reason=reason,
                               attempts=attempts.get(site, 1)))
    for _, m in accepted:
        site = m.site or "?"
        sites.append(SiteRound(site=site, state="completed", num_samples=m.num_samples,
                               num_tokens=m.num_tokens, loss=m.metrics.get("loss"),
                               train_seconds=m.metrics.get("train_seconds"),
                               attempts=attempts.get(site, 1)))
    if len(accepted) < min_sites:
        registry.finish_round(run_id, RoundRecord(
            round=rnd, state="failed", ended=time.time(), sites=sites))
        lost = "; ".join(f"{s.site}: {s.reason}" for s in sites if s.state != "completed")
        raise QuorumNotMet(f"round {rnd}: {len(accepted)} valid update(s), the job needs "
                           f"{min_sites} (failure.min_sites) ({lost or 'no update'})")
    target = Path(run_dir) / "rounds" / str(rnd) / "global"
    t0 = time.perf_counter()
    run_strategy(
        strategy, [d for d, _ in accepted], previous_dir, target,
        weighting=weighting, params=params or {}, run_id=run_id,  # type: ignore[arg-type]
        round=rnd, parent_digest=previous.digest(), max_shard_size=max_shard_size,
    )
    seconds = time.perf_counter() - t0
    failpoint(f"aggregated-round-{rnd}")  # the global is on disk, the registry not updated
    for update_dir, m in accepted:  # keep what was aggregated beside the result (hardlinks)
        kept = target.parent / "updates" / (m.site or update_dir.name)
        if not kept.exists():
            _link_tree(update_dir, kept)
    manifest = read_manifest(target)
    registry.finish_round(run_id, RoundRecord(
        round=rnd, state="completed", started=None, ended=time.time(),
        aggregate_seconds=seconds, global_path=str(target), global_digest=manifest.digest(),
        num_samples=manifest.num_samples, loss=manifest.metrics.get("loss"), sites=sites,
    ))
    print(f"round {rnd}: aggregated {len(accepted)} updates in {seconds:.2f} s")
    return target


def run_step(args: argparse.Namespace) -> int:
    """Aggregate one round as main.cwl's aggregate step; return the process exit code."""
    registry = Registry(Path(args.registry))
    rnd: int = args.round
    try:
        target = aggregate_round(
            args.run_id, Path(args.run_dir), registry, rnd, Path(args.previous),
            [Path(u) for u in args.updates], strategy=args.strategy,
            weighting=args.weighting, params=parse_pairs(args.param),
            max_shard_size=args.max_shard_size,
        )
    except QuorumNotMet as exc:
        print(str(exc), file=sys.stderr)
        return 1
    _link_tree(target, Path.cwd() / "global")
    go = rnd < args.max_rounds
    if go:
        registry.start_round(args.run_id, rnd + 1, registry.get_run(args.run_id).sites)
    out = {"model": {"class": "Directory", "path": str(Path.cwd() / "global")},
           "next_round": rnd + 1, "go": go}
    Path("cwl.output.json").write_text(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m xffl.workflows.aggregate_step ...`` (the plan's aggregate tool)."""
    parser = argparse.ArgumentParser(prog="xffl.workflows.aggregate_step")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--registry", required=True)
    parser.add_argument("--weighting", default="samples")
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--param", action="append", default=[], help="KEY=NUMBER")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, help="0: one file")
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--max-rounds", type=int, required=True)
    parser.add_argument("--previous", required=True)
    parser.add_argument("updates", nargs="+")
    return run_step(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
