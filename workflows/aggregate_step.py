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
from xffl.jobs.registry import Registry, RoundRecord, SiteRound


def _link_tree(src: Path, dst: Path) -> None:
    """Expose ``src`` as ``dst`` (the step's output) by hardlinks, falling back to copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        try:
            os.link(item, dst / item.name)
        except OSError:
            shutil.copy2(item, dst / item.name)


def run_step(args: argparse.Namespace) -> int:
    """Aggregate one round; return the process exit code."""
    registry = Registry(Path(args.registry))
    rnd: int = args.round
    started = time.time()
    previous = verify_checkpoint(Path(args.previous))
    accepted, rejected = select_updates(
        [Path(u) for u in args.updates], expected_round=rnd,
        expected_parent=previous.digest(), reference_index=previous.tensors,
    )
    sites: list[SiteRound] = []
    for _, site, reason in rejected:
        print(f"rejected update from {site}: {reason}", file=sys.stderr)
        sites.append(SiteRound(site=site, state="rejected", reason=reason))
    for _, m in accepted:
        sites.append(SiteRound(site=m.site or "?", state="completed", num_samples=m.num_samples,
                               num_tokens=m.num_tokens, loss=m.metrics.get("loss"),
                               train_seconds=m.metrics.get("train_seconds")))
    if not accepted:
        registry.finish_round(args.run_id, RoundRecord(
            round=rnd, state="failed", ended=time.time(), sites=sites))
        print(f"round {rnd}: no valid update to aggregate", file=sys.stderr)
        return 1
    target = Path(args.run_dir) / "rounds" / str(rnd) / "global"
    t0 = time.perf_counter()
    params = parse_pairs(args.param)
    run_strategy(
        args.strategy, [d for d, _ in accepted], Path(args.previous), target,
        weighting=args.weighting, params=params, run_id=args.run_id, round=rnd,
        parent_digest=previous.digest(), max_shard_size=args.max_shard_size,
    )
    seconds = time.perf_counter() - t0
    _link_tree(target, Path.cwd() / "global")
    for update_dir, m in accepted:  # keep what was aggregated beside the result (hardlinks)
        kept = target.parent / "updates" / (m.site or update_dir.name)
        if not kept.exists():
            _link_tree(update_dir, kept)
    manifest = read_manifest(target)
    registry.finish_round(args.run_id, RoundRecord(
        round=rnd, state="completed", started=None, ended=time.time(),
        aggregate_seconds=seconds, global_path=str(target), global_digest=manifest.digest(),
        num_samples=manifest.num_samples, loss=manifest.metrics.get("loss"), sites=sites,
    ))
    go = rnd < args.max_rounds
    if go:
        registry.start_round(args.run_id, rnd + 1, [s.site for s in sites])
    out = {"model": {"class": "Directory", "path": str(Path.cwd() / "global")},
           "next_round": rnd + 1, "go": go}
    Path("cwl.output.json").write_text(json.dumps(out))
    print(f"round {rnd}: aggregated {len(accepted)} updates in {seconds:.2f} s "
          f"(started {time.time() - started:.2f} s ago); go={go}")
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
