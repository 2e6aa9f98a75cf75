"""The CPU seconds a coordinator step's process spends before its work: Python and its imports.

Each round starts one admit process per site and one aggregate process on the coordinator
(``python -m xffl.workflows.steps.<step>``); the last admission and the aggregation are on the
round's critical path. This runs, N times each, a process that does what such a step does
before its ``main``: import its module (``python -c "import <module>"``; ``-m`` would run
it), and prints the median user+system CPU seconds of each, with a bare interpreter's
(``pass``) as the floor, from ``getrusage(RUSAGE_CHILDREN)``: CPU time, not wall time, so it
holds on a machine shared with other work.

    python bench/round_overhead/startup.py [-n 15] [MODULE ...]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

# a step's module (what a cold step imports), and what a step's command imports when the
# warm step server runs it (xffl.workflows.steps.warm)
STEPS = ("xffl.workflows.steps.admit", "xffl.workflows.steps.aggregate",
         "xffl.workflows.steps.handoff")


def cpu_seconds(code: str) -> float:
    """User+system CPU seconds of one ``python -c code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    """Print the median CPU seconds of a bare interpreter and of each module's import."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=15, help="processes per module")
    p.add_argument("modules", nargs="*", default=list(STEPS))
    args = p.parse_args(argv)
    for label, code in [("(bare interpreter)", "pass")] + [
            (m, f"import {m}") for m in args.modules]:
        runs = sorted(cpu_seconds(code) for _ in range(args.n))
        print(f"{statistics.median(runs):6.3f} CPU-s median (min {runs[0]:.3f}, "
              f"max {runs[-1]:.3f}, n={args.n})  {label}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
