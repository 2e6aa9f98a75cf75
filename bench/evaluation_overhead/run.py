"""Benchmark: what federated evaluation adds to the quickstart's wall time.

The quickstart job (examples/quickstart.yaml: 2 local sites x 2 DDP ranks, 3 rounds, each site
holding out a tenth of its corpus) runs through ``xffl submit --wait``, alternately as it is
(every round each site evaluates the incoming global and its own update) and without
``data.validation`` (no evaluation), in the same invocation, so that both see the same
machine. Reported: the median wall time of each, their ratio (the target: at most 1.10), and
the seconds the sites spent evaluating, from the updates' manifests (``eval_seconds``).

    python bench/evaluation_overhead/run.py               # 3 runs of each
    python bench/evaluation_overhead/run.py --repeat 5 --json

``--sites N`` keeps the quickstart's first N sites and ``--no-final`` turns its final
evaluation off (``evaluation.final: false``): the test suite's smallest runs that still show
the difference.
"""

from __future__ import annotations

import argparse
import json
import os
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
TARGET = 1.10


def write_job(work: Path, evaluate: bool, rounds: int | None, steps: int | None,
              ranks: int | None, sites: int | None = None, final: bool = True) -> Path:
    """The quickstart, with or without its sites' held-out data (its first ``sites`` sites;
    without its final evaluation when not ``final``)."""
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    if sites is not None:
        spec["sites"] = spec["sites"][:sites]
    if not final:
        spec["evaluation"] = {"final": False}
    if rounds is not None:
        spec["rounds"] = rounds
    if steps is not None:
        spec["training"]["steps"] = steps
    for site in spec["sites"]:
        if ranks is not None:
            site["ranks"] = ranks
        if not evaluate:
            site["data"].pop("validation", None)
    job = work / ("with.yaml" if evaluate else "without.yaml")
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def run_once(job: Path, home: Path) -> dict[str, Any]:
    """Submit and wait; the wall time and the sites' evaluation seconds per round."""
    env = {**os.environ, "XFFL_HOME": str(home)}
    began = time.perf_counter()
    done = subprocess.run([str(XFFL), "submit", str(job), "--wait", "--json"], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"xffl submit failed ({done.returncode}): {done.stderr[-2000:]}")
    status = json.loads(done.stdout)
    run_dir = Path(status["run_dir"])
    evals = [json.loads(m.read_text())["metrics"].get("eval_seconds", 0.0)
             for m in sorted(run_dir.glob("rounds/*/updates/*/manifest.json"))]
    return {"run_id": status["run_id"], "wall_s": wall, "eval_s": evals,
            "val_loss": [r["val_loss"] for r in status["rounds"]]}


def main(argv: list[str] | None = None) -> int:
    """Run both variants ``--repeat`` times, alternating; print the medians and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant")
    parser.add_argument("--rounds", type=int, default=None, help="(default: the quickstart's)")
    parser.add_argument("--steps", type=int, default=None, help="(default: the quickstart's)")
    parser.add_argument("--ranks", type=int, default=None, help="(default: the quickstart's)")
    parser.add_argument("--sites", type=int, default=None,
                        help="the quickstart's first N sites (default: both)")
    parser.add_argument("--no-final", action="store_true",
                        help="no final evaluation (evaluation.final: false) in either variant")
    parser.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xffl-bench-eval-") as tmp:
        work = Path(tmp)
        jobs = {name: write_job(work, name == "with", args.rounds, args.steps, args.ranks,
                                args.sites, not args.no_final)
                for name in ("without", "with")}
        runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
        for i in range(args.repeat):
            for name, job in jobs.items():  # alternating, so drift hits both alike
                runs[name].append(run_once(job, work / f"home-{name}-{i}"))
                print(f"{name:>7} evaluation, run {i + 1}: "
                      f"{runs[name][-1]['wall_s']:.1f} s", flush=True)
    median = {name: statistics.median(r["wall_s"] for r in rows) for name, rows in runs.items()}
    ratio = median["with"] / median["without"]
    evals = [s for r in runs["with"] for s in r["eval_s"]]
    print(f"quickstart wall time, median of {args.repeat}: without evaluation "
          f"{median['without']:.1f} s, with {median['with']:.1f} s")
    print(f"ratio with/without: {ratio:.3f} (target <= {TARGET:.2f})")
    print(f"evaluation inside the sites' jobs: {statistics.mean(evals):.2f} s per site and "
          f"round (the incoming global and the update)")
    if args.json:
        print(json.dumps({"median_s": median, "ratio": ratio, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
