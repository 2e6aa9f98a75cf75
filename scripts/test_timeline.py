"""What each pytest worker ran while the machine's cores idled: a suite's schedule, read back.

Usage: ``XFFL_TEST_TIMELINE=/tmp/tl bash scripts/test.sh`` beside
``scripts/test_timeline.py --sample /tmp/cpu.txt`` (samples the busy cores every 5 s until
killed), then ``scripts/test_timeline.py --report /tmp/tl --cpu /tmp/cpu.txt``: for each
5-second window with fewer than ``--below`` cores busy (1.2), the tests the workers were in.
``scripts/test_timeline.py --own 20 --report /tmp/tl``: the 20 test files whose tests cost the
workers the most CPU-seconds of their own (children not counted: a test's subprocesses and
SLURM jobs are ``scripts/process_profile.py``'s).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import time
from pathlib import Path
from typing import Any


def _busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def sample(out: Path, interval: float = 5.0) -> None:
    """Append ``<unix time> <busy cores>`` to ``out`` every ``interval`` seconds."""
    cores = os.cpu_count() or 1
    busy, total = _busy_ticks()
    while True:
        time.sleep(interval)
        b, t = _busy_ticks()
        with out.open("a") as f:
            f.write(f"{time.time():.1f} {cores * (b - busy) / max(t - total, 1):.2f}\n")
        busy, total = b, t


def _runs(prefix: str) -> list[dict[str, Any]]:
    """Every test's record (test, start, end, the worker's own CPU) with its worker."""
    return [json.loads(line) | {"worker": Path(f).suffix[1:]}
            for f in sorted(glob.glob(f"{prefix}.*")) for line in Path(f).read_text().splitlines()]


def own(prefix: str, top: int) -> None:
    """Print the ``top`` test files by the workers' own CPU-seconds in their tests."""
    runs = _runs(prefix)
    by_file: collections.defaultdict[str, float] = collections.defaultdict(float)
    for r in runs:
        by_file[str(r["test"]).split("::", 1)[0]] += float(r.get("cpu", 0.0))
    print(f"the workers' own CPU-seconds in {len(runs)} tests: {sum(by_file.values()):.1f}")
    for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{seconds:7.1f}  {name}")


def report(prefix: str, cpu: Path, below: float) -> None:
    """Print the idle windows and the tests each worker was in during them."""
    runs = _runs(prefix)
    samples = [tuple(map(float, line.split())) for line in cpu.read_text().splitlines()]
    first = min(r["start"] for r in runs)
    idle = 0.0
    for (end, cores), prev in zip(samples[1:], samples, strict=False):
        start = prev[0]
        if cores >= below or end < first:
            continue
        idle += (end - start) * ((os.cpu_count() or 1) - cores)
        inside = sorted({f'{r["worker"]} {r["test"][:110]}' for r in runs
                         if r["start"] < end and r["end"] > start})
        print(f"{start - first:6.0f}s {cores:4.2f} cores: " + " | ".join(inside))
    print(f"idle core-seconds in windows below {below}: {idle:.0f}")


def main() -> None:
    """Sample, or report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sample", type=Path)
    parser.add_argument("--report")
    parser.add_argument("--cpu", type=Path)
    parser.add_argument("--below", type=float, default=1.2)
    parser.add_argument("--own", type=int, help="the N files costing the workers the most")
    args = parser.parse_args()
    if args.sample:
        sample(args.sample)
    elif args.own:
        own(args.report, args.own)
    else:
        report(args.report, args.cpu, args.below)


if __name__ == "__main__":
    main()
