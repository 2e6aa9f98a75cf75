"""bench/round_overhead/cpu.py: a run's CPU seconds from /proc, split into the supervisor's own
and its step processes', against what each real process says it used."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.scripts import load_bench

# A process burning CPU in a loop, then reporting its own user+system seconds (getrusage).
BURN = ("import resource, json, sys\n"
        "x = 0\n"
        "for i in range(int(sys.argv[1])): x += i * i\n"
        "r = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print(json.dumps(r.ru_utime + r.ru_stime))\n")
# The stand-in supervisor (its argv names the supervisor's module, its cwd is the run dir):
# runs one burning child, waits for it, burns some itself, reports both, then idles until
# the test says so.
SUPERVISOR = ("import json, resource, subprocess, sys, time\n"
              "child = json.loads(subprocess.run([sys.executable, '-c', sys.argv[1], '3000000'],"
              " capture_output=True, text=True, check=True).stdout)\n"
              "x = 0\n"
              "for i in range(2000000): x += i\n"
              "r = resource.getrusage(resource.RUSAGE_SELF)\n"
              "print(json.dumps([r.ru_utime + r.ru_stime, child]), flush=True)\n"
              "sys.stdin.read()\n")


def test_a_window_counts_the_supervisor_and_its_children_apart(tmp_path: Path) -> None:
    cpu = load_bench("round_overhead", "cpu.py")
    run_dir = tmp_path / "home" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    sampler = cpu.CpuSampler(tmp_path)
    sampler.start()
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, BURN, "xffl.workflows.supervisor"],
                            cwd=run_dir, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdin is not None
    own, child = json.loads(proc.stdout.readline())
    time.sleep(3 * cpu.PERIOD)  # a sample after both reports
    end = time.time()
    proc.stdin.close()
    proc.wait(timeout=60)
    sampler.stop()
    (row,) = sampler.per_round([(start, end)])
    # /proc counts in ticks (1/SC_CLK_TCK s) where getrusage counts in microseconds: each of
    # utime and stime is up to one tick below (truncated), and the sampler's first sample may
    # come one tick into the process's life: 3 ticks. A child counted as the supervisor's own
    # time (or not at all) is off by its whole 0.1+ s.
    tol = 3 / cpu.TICK
    assert abs(row["steps"] - child) <= tol, (row, child)
    assert own - tol <= row["self"] <= own + tol, (row, own)
    assert child > 5 * tol  # the child's burn is far above the tolerance
