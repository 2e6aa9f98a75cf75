"""``python -m xffl.aggregator``: verify site updates and aggregate them into a global checkpoint.

Example::

    python -m xffl.aggregator -o rounds/3/global --round 3 --parent rounds/2/global \\
        --strategy fedadam updates/leonardo updates/karolina
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.fedavg import WEIGHTINGS
from xffl.aggregator.strategies import STRATEGIES, parse_pairs, run_strategy
from xffl.aggregator.verify import select_updates
from xffl.core.errors import RunFailed, XfflError
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE, parse_size


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the aggregator entry point."""
    p = argparse.ArgumentParser(
        prog="python -m xffl.aggregator",
        description="Check site updates and write their weighted average (FedAvg) atomically.",
        epilog="example: python -m xffl.aggregator -o rounds/3/global --round 3 "
        "--parent rounds/2/global updates/site-a updates/site-b",
    )
    p.add_argument(
        "updates",
        nargs="+",
        type=Path,
        metavar="UPDATE",
        help="update checkpoint directories (model.safetensors or shards + index, manifest.json)",
    )
    p.add_argument("-o", "--output", required=True, type=Path, help="global checkpoint to write")
    p.add_argument(
        "--weighting",
        choices=WEIGHTINGS,
        default="samples",
        help="weight each update by its samples, tokens, or equally (default samples)",
    )
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="SITE=W",
        help="explicit weight of one site (repeat per site; overrides --weighting)",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="fedavg",
        help="aggregation strategy (default fedavg)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=V",
        help="a strategy parameter, e.g. --param eta=0.01 (repeat per parameter)",
    )
    p.add_argument(
        "--previous",
        type=Path,
        metavar="DIR",
        help="the previous global checkpoint, holding the server state of stateful "
        "strategies (default: --parent)",
    )
    p.add_argument("--run-id", help="accept only updates of this run")
    p.add_argument("--round", type=int, help="accept only updates of this round")
    parent = p.add_mutually_exclusive_group()
    parent.add_argument(
        "--parent",
        type=Path,
        metavar="DIR",
        help="the global checkpoint the round started from: updates must name it "
        "as parent and match its tensors",
    )
    parent.add_argument(
        "--parent-digest", metavar="HEX", help="digest the updates must name as parent"
    )
    p.add_argument(
        "--min-updates",
        type=int,
        default=1,
        help="fail (exit 1) when fewer updates are accepted (default 1)",
    )
    p.add_argument(
        "--no-finite-check", action="store_true", help="skip the NaN/Inf scan of update tensors"
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="split a larger global model into Hugging Face shards with an index json, "
        f"e.g. 500MB or 2GiB; 0 never splits (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Select the updates, aggregate the accepted ones and describe what happened."""
    max_shard_size = parse_size(args.max_shard_size)  # a bad size fails before any work
    reference = None
    parent_digest = args.parent_digest
    if args.parent is not None:
        parent_manifest = read_manifest(args.parent)
        parent_digest = parent_manifest.digest()
        reference = parent_manifest.tensors
    accepted, rejected = select_updates(
        args.updates,
        expected_round=args.round,
        expected_parent=parent_digest,
        reference_index=reference,
        expected_run_id=args.run_id,
        check_finite=not args.no_finite_check,
    )
    report: dict[str, Any] = {
        "output": str(args.output),
        "rejected": [{"dir": str(d), "site": s, "reason": r} for d, s, r in rejected],
    }
    if len(accepted) < max(1, args.min_updates):
        report["error"] = (
            f"{len(accepted)} update(s) accepted, at least {max(1, args.min_updates)} needed."
        )
        return report
    weighting = parse_pairs(args.weight, "--weight", "SITE", "leonardo=2") or args.weighting
    manifest = run_strategy(
        args.strategy,
        [d for d, _ in accepted],
        args.previous if args.previous is not None else args.parent,
        args.output,
        weighting=weighting,
        params=parse_pairs(args.param),
        run_id=args.run_id,
        round=args.round,
        parent_digest=parent_digest,
        max_shard_size=max_shard_size,
    )
    sites = manifest.extra["sites"]
    report["used"] = [
        {
            "dir": str(d),
            "site": m.site,
            "num_samples": m.num_samples,
            "weight": sites[m.site]["weight"] if m.site else None,
        }
        for d, m in accepted
    ]
    report["global"] = {
        "round": manifest.round,
        "strategy": args.strategy,
        "digest": manifest.digest(),
        "num_samples": manifest.num_samples,
        "metrics": manifest.metrics,
        "files": sorted(manifest.files),
    }
    return report


def _render(report: dict[str, Any]) -> str:
    lines = [
        f"used      {u['site']:<16} {u['dir']}  samples={u['num_samples']} weight={u['weight']:.4f}"
        for u in report.get("used", [])
    ]
    lines += [f"rejected  {r['site']:<16} {r['dir']}  {r['reason']}" for r in report["rejected"]]
    if "global" in report:
        g = report["global"]
        lines.append(
            f"wrote global round {g['round']} to {report['output']} "
            f"(digest {g['digest'][:12]}, {g['num_samples']} samples)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 too few updates, 2 bad input)."""
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except XfflError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return int(exc.exit_code)
    print(json.dumps(report, indent=2) if args.json else _render(report))
    if "error" in report:
        print(f"error: {report['error']}", file=sys.stderr)
        return int(RunFailed.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
