"""Benchmark: `xffl simulate` memory and time per site against N and a standalone site.

Runs, each in a fresh process (so the measurements are independent):

  simulate N=n, K   ``xffl simulate job.yaml --sites n --parallel K --rounds 1 --json`` for
                    every n of --sizes and every K of --parallel; the parent's peak RSS is
                    its own VmHWM, recorded in simulate.json (the workers are other
                    processes, whose memory does not depend on N either)
  standalone        one site trained on its own: in one fresh process, --trials sites
                    (virtual sites with their own data, outside the simulation) each make
                    their data and train one round from the same global model with the same
                    trainer call real sites use (``train_round``), one after another; the
                    median time per site

Time per site of a simulation = its round 1 seconds (training every site, verifying and
folding each update, writing the global) / n. With K=1 this is what the simulator costs per
site on top of training it alone (target: within 10%); with K>1 sites train side by side
on the machine's cores, so it drops below the standalone time. Process start-up, the pool
and round 0 are one-off costs, shown in the total wall time. The simulations and the
standalone sites alternate --repeat times; times are medians, peak RSS the highest. The
job is the quickstart with the smallest preset (tiny-test) and --steps optimizer steps of
4 x 32 tokens per site.

    python bench/simulate/run.py                       # N = 10 and 100, K = 1 and 2
    python bench/simulate/run.py --sizes 10,100,1000 --parallel 1,4 --json
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
sys.path.insert(0, str(REPO))


def write_job(work: Path, steps: int) -> Path:
    """The quickstart, shrunk: tiny-test model, ``steps`` steps of 4 x 32 tokens per site."""
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec.update(name="simbench", rounds=1)
    spec["model"]["preset"] = "tiny-test"
    spec["training"].update(steps=steps, batch_size=4, seq_len=32)
    for site in spec["sites"]:
        site["data"]["synthetic_sequences"] = 64
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _xffl() -> list[str]:
    exe = Path(sys.executable).with_name("xffl")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "from xffl.cli.app import main; main()"]


def run_simulate(job: Path, out: Path, sites: int, parallel: int,
                 timeout: float) -> dict[str, Any]:
    """One `xffl simulate` in a fresh process: its wall time and its simulate.json."""
    t0 = time.perf_counter()
    proc = subprocess.run([*_xffl(), "simulate", str(job), "--sites", str(sites), "--parallel",
                           str(parallel), "--rounds", "1", "-o", str(out), "--json"],
                          capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"xffl simulate --sites {sites} failed ({proc.returncode}):\n"
                         f"{proc.stderr}")
    summary = json.loads((out / "simulate.json").read_text())
    round1 = summary["rounds"][0]
    return {"sites": sites, "parallel": summary["parallel"], "wall_s": wall,
            "round_s": round1["wall_s"], "per_site_s": round1["wall_s"] / sites,
            "peak_rss_mib": summary["peak_rss_bytes"] / 2**20,
            "train_s": round1["train_s_mean"], "mean_loss": round1["mean_loss"],
            "dir": str(out)}


STANDALONE = """
import json, sys, time
from pathlib import Path
from xffl.jobs.spec.load import load_job
from xffl.workflows.simulate_sites import init_worker, run_site, virtual_site
job, model, root, trials, threads = sys.argv[1:6]
init_worker(int(threads))
loaded, times = load_job(Path(job)), []
for i in range(int(trials)):
    site = virtual_site(loaded, i, int(trials), Path(root), Path(root).name, 1)
    t0 = time.perf_counter()
    outcome = run_site(site, 1, model, str(Path(root) / "updates" / site.name))
    times.append(time.perf_counter() - t0)
    if not outcome.ok:
        sys.exit(f"standalone site {site.name}: {outcome.error}")
print(json.dumps(times))
"""


def run_standalone(job: Path, sim_dir: Path, work: Path, trials: int,
                   timeout: float) -> dict[str, Any]:
    """Sites trained alone, one after another in one warm process: median seconds per site.

    Each is a virtual site with its own fresh data folder under ``work/standalone`` (so it
    makes its data, as a simulated site does), trained from ``sim_dir``'s round-0 global
    with every core's torch threads (as a K=1 worker).
    """
    from xffl.core.resources import usable_cpus

    root = work / "standalone"
    proc = subprocess.run(
        [sys.executable, "-c", STANDALONE, str(job), str(sim_dir / "rounds" / "0" / "global"),
         str(root), str(trials), str(usable_cpus())],
        capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"standalone sites failed ({proc.returncode}):\n{proc.stderr}")
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    trains = [json.loads((u / "manifest.json").read_text())["metrics"]["train_seconds"]
              for u in sorted((root / "updates").iterdir())]
    return {"per_site_s": statistics.median(times), "first_s": times[0],
            "train_s": statistics.median(trains), "trials": times}


def _combine(k: int, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over its repeats: medians of the times, the highest peak RSS."""
    med = statistics.median
    return {"k": k, "sites": reps[0]["sites"], "parallel": reps[0]["parallel"],
            "wall_s": med(r["wall_s"] for r in reps), "round_s": med(r["round_s"] for r in reps),
            "per_site_s": med(r["per_site_s"] for r in reps),
            "per_site_runs": [r["per_site_s"] for r in reps],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in reps),
            "train_s": med(r["train_s"] for r in reps), "dir": reps[-1]["dir"]}


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every run of the benchmark, and the ratios.

    The simulations and the standalone sites alternate, --repeat times, and each side is
    summed up by its medians, so the drifts of a shared machine's speed weigh on both alike.
    """
    job = write_job(work, args.steps)
    sizes = [int(s) for s in args.sizes.split(",")]
    ks = [int(k) for k in args.parallel.split(",")]
    plan = [(k, n) for k in ks for n in sizes]
    reps: dict[tuple[int, int], list[dict[str, Any]]] = {c: [] for c in plan}
    alone: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        for k, n in plan:
            reps[(k, n)].append(run_simulate(job, work / f"sim-{n}-k{k}-{rep}", n, k,
                                             args.timeout))
        model = Path(reps[plan[0]][0]["dir"])  # its round-0 global: the standalone's model
        alone.append(run_standalone(job, model, work / f"alone-{rep}", args.trials,
                                    args.timeout))
    runs = [_combine(k, reps[(k, n)]) for k, n in plan]
    trials = [t for a in alone for t in a["trials"]]
    base = {"per_site_s": statistics.median(trials), "trials": trials,
            "train_s": statistics.median(a["train_s"] for a in alone),
            "first_s": [a["first_s"] for a in alone]}
    rss = {k: [r for r in runs if r["k"] == k] for k in ks}  # K is at most N
    return {
        "steps": args.steps, "repeat": args.repeat, "cores": os.cpu_count(),
        "simulate": runs, "standalone": base,
        "rss_ratio": {f"K={k} N={rs[-1]['sites']}/N={rs[0]['sites']}":
                      rs[-1]["peak_rss_mib"] / rs[0]["peak_rss_mib"] for k, rs in rss.items()},
        "per_site_ratio": {f"K={r['parallel']} N={r['sites']}":
                           r["per_site_s"] / base["per_site_s"] for r in runs},
    }


def render(result: dict[str, Any]) -> str:
    """The table and the ratios as text."""
    rows = [("run", "total wall s", "round 1 s", "per site s", "vs standalone",
             "train loop s/site", "parent peak MiB")]
    base = result["standalone"]["per_site_s"]
    for r in result["simulate"]:
        rows.append((f"simulate N={r['sites']} K={r['parallel']}", f"{r['wall_s']:.2f}",
                     f"{r['round_s']:.2f}", f"{r['per_site_s']:.4f}",
                     f"{r['per_site_s'] / base:.3f}", f"{r['train_s']:.4f}",
                     f"{r['peak_rss_mib']:.1f}"))
    rows.append((f"standalone site (median of {len(result['standalone']['trials'])})", "", "",
                 f"{base:.4f}", "1.000", f"{result['standalone']['train_s']:.4f}", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    for key, ratio in result["rss_ratio"].items():
        lines.append(f"parent peak RSS {key}: {ratio:.3f} (target <= 1.1)")
    for key, ratio in result["per_site_ratio"].items():
        target = "(target <= 1.1)" if key.startswith("K=1 ") else "(K sites side by side)"
        lines.append(f"time per site {key} / standalone site: {ratio:.3f} {target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100", help="numbers of virtual sites N")
    parser.add_argument("--parallel", default="1,2", help="numbers of workers K")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per site")
    parser.add_argument("--trials", type=int, default=5,
                        help="standalone sites per repeat (median of all)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="times every simulation and the standalone sites run (medians)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xffl-simbench-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = measure(args, work)
    print(json.dumps(result, indent=2) if args.json else render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
