"""Benchmark: what the final model's evaluation (main.cwl's final steps) adds to a run.

The quickstart job (examples/quickstart.yaml: 2 local sites x 2 DDP ranks, 3 rounds) is
submitted with ``--no-start`` and its supervisor run here as a child process, alternately
as it is (``evaluation.final: true``, the default: after round 3 every site evaluates the
final global) and with ``evaluation.final: false``, in the same invocation, so that both see
the same machine. Reported: the median wall time and CPU time (the supervisor and every
process under it: StreamFlow's steps, torchrun and its ranks, all waited for) of each, and
their ratios.

    python bench/final_evaluation/run.py               # 3 runs of each
    python bench/final_evaluation/run.py --repeat 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
XFFL = Path(sys.executable).parent / "xffl"


def write_job(work: Path, final: bool) -> Path:
    """The quickstart, with or without its final evaluation."""
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec["evaluation"] = {"final": final}
    job = work / ("with.yaml" if final else "without.yaml")
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def run_once(job: Path, home: Path) -> dict[str, Any]:
    """Submit without starting, run the supervisor as a child; its wall and CPU seconds."""
    env = {**os.environ, "XFFL_HOME": str(home)}
    made = subprocess.run([str(XFFL), "submit", str(job), "--no-start", "--json"], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    run_id = json.loads(made.stdout)["run_id"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "xffl.workflows.supervisor", run_id], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the supervisor failed ({done.returncode}): {done.stdout[-2000:]}")
    status = json.loads(subprocess.run([str(XFFL), "status", run_id, "--json"], env=env,
                                       capture_output=True, text=True, timeout=60,
                                       check=True).stdout)
    if status["state"] != "completed":
        raise SystemExit(f"run {run_id}: {status['state']}: {status['message']}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "final_loss": status["final_loss"]}


def main() -> int:
    """Run the benchmark and print its numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="xffl-final-bench-") as tmp:
        work = Path(tmp)
        jobs = {"with": write_job(work, True), "without": write_job(work, False)}
        for i in range(args.repeat):
            for name in ("without", "with"):
                result = run_once(jobs[name], work / f"home-{name}-{i}")
                runs[name].append(result)
                print(f"{name} final evaluation, run {i + 1}: wall {result['wall_s']:.1f} s, "
                      f"CPU {result['cpu_s']:.1f} s", file=sys.stderr, flush=True)
    assert all(r["final_loss"] is not None for r in runs["with"])
    assert all(r["final_loss"] is None for r in runs["without"])
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
           for name, rs in runs.items()}
    report = {"repeat": args.repeat, "load_1min": os.getloadavg()[0], "median": med,
              "wall_ratio": med["with"]["wall_s"] / med["without"]["wall_s"],
              "cpu_ratio": med["with"]["cpu_s"] / med["without"]["cpu_s"],
              "runs": {n: [{k: r[k] for k in ("wall_s", "cpu_s")} for r in rs]
                       for n, rs in runs.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name in ("without", "with"):
            print(f"{name:8s} final evaluation: median wall {med[name]['wall_s']:.1f} s, "
                  f"CPU {med[name]['cpu_s']:.1f} s")
        print(f"ratio with/without: wall {report['wall_ratio']:.3f}, CPU "
              f"{report['cpu_ratio']:.3f} (load average {report['load_1min']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
