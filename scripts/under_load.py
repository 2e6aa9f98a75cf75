"""Run one test again and again beside CPU hogs: a timing-dependent test that passes only on a
quiet machine fails here.

Usage: ``.venv/bin/python scripts/under_load.py --runs 20 --hogs 2 tests/x.py::test_y``

Each run is a fresh ``pytest -p no:xdist`` process (a test that needs the SLURM stack starts
its own, as CI's workers do) with ``CI=true``; ``--hogs`` processes spin on the CPU for the
whole series. It stops at the first failure, printing the end of that run's output, and exits
1; else it prints each run's wall time and exits 0. Results go to stdout as one line per run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time


def _spin() -> None:
    """Burn one core until killed."""
    while True:
        pass


def main(argv: list[str]) -> int:
    """Run the series; 0 when every run passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    parser.add_argument("--hogs", type=int, default=2, help="spinning processes (default 2)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("tests", nargs="+", help="pytest node ids")
    args = parser.parse_args(argv)
    # a SIGTERM ends the series through the finally below, which stops the hogs
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-q", *args.tests]
    env = {**os.environ, "CI": "true"}
    try:
        for run in range(1, args.runs + 1):
            start = time.monotonic()
            try:
                done = subprocess.run(command, env=env, capture_output=True, text=True,
                                      timeout=args.timeout)
                code, out = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as late:
                code, out = -1, f"timed out after {args.timeout} s\n{late.stdout!r}"
            wall = time.monotonic() - start
            print(f"run {run}/{args.runs}: {'passed' if code == 0 else 'FAILED'} in "
                  f"{wall:.1f} s (hogs: {args.hogs})", flush=True)
            if code != 0:
                print(out[-6000:], flush=True)
                return 1
        print(f"{args.runs} of {args.runs} runs passed beside {args.hogs} CPU hogs: "
              f"{' '.join(args.tests)}", flush=True)
        return 0
    finally:
        for hog in hogs:
            hog.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
