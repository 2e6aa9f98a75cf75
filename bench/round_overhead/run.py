"""Benchmark: xffl's per-round orchestration overhead on the SLURM test stack, against a baseline.

Both sides train the same tiny-model job on the two test clusters (alpha, beta; SLURM over SSH
on 127.0.0.1) for R rounds, in the same invocation:

  xffl      ``xffl submit job.yaml --wait``: the run's one StreamFlow workflow (main.cwl: SLURM
            over SSH at both sites, admission and aggregation on the coordinator)
  wait      the baseline, a hand-written loop doing the same round: scp of the global model
            to each site, ``sbatch --wait`` of the same batch script (``xffl render``'s
            sbatch/<site>.sh) at both sites in parallel over ssh, scp of the updates back,
            then the same FedAvg call (xffl.aggregator.engine.run_strategy)
  poll      the same, but waiting with ``squeue -j ID`` every polling interval (as StreamFlow
            does) instead of ``sbatch --wait``, which checks on the job after 2, 10 and 42 s

Per round, overhead = round wall time - the slowest site's time inside its job, where a
site's time is the launcher's own wall time in the job (torch start-up, training, saving:
``slurm_job.json``), the same script on both sides. Round wall time: xffl's from the run
registry (round started -> round recorded), the baseline's from its first copy to its
aggregate. The manifests' ``train_seconds`` (the training loop alone) are shown too.

    python bench/round_overhead/run.py               # 3 rounds, 6 steps per round
    python bench/round_overhead/run.py --rounds 5 --json

``--sites 1`` runs alpha alone (the test suite's smoke: the same paths at half the jobs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.round_overhead import cpu  # noqa: E402
from bench.round_overhead.breakdown import breakdown, show  # noqa: E402
from tests.stack import stack  # noqa: E402  (the repo's stack driver: stdlib only)
from tests.stack.profiles import write_profile  # noqa: E402
from xffl.aggregator.engine import run_strategy  # noqa: E402
from xffl.aggregator.exchange import read_manifest  # noqa: E402

SITES = ("alpha", "beta")


def write_job(work: Path, info: stack.StackInfo, rounds: int, steps: int,
              polling: float, ranks: int = 2, sites: tuple[str, ...] = SITES) -> Path:
    """The quickstart on the test clusters ``sites`` (both by default), srun -n RANKS at each
    (as the SLURM tests)."""
    profiles = work / "site_profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec.update(name="overhead", rounds=rounds)
    spec["training"]["steps"] = steps
    spec["sites"] = [site for site in spec["sites"] if site["name"] in sites]
    for site in spec["sites"]:
        site["profile"] = write_profile(profiles, info.clusters[site["name"]], info)
        site["data"]["path"] = str(work / "data" / site["name"])
        site["slurm"] = {"polling_interval": polling}
        site["ranks"] = ranks
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _xffl(env: dict[str, str], *args: str, timeout: float = 1800) -> str:
    """Run the xffl CLI of this venv; its stdout (exit on failure)."""
    exe = Path(sys.executable).with_name("xffl")
    proc = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        # under --json the run's status (with the reason it failed) is on stdout
        raise SystemExit(f"xffl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
                         f"{proc.stdout[-3000:]}")
    return proc.stdout


def site_times(update: Path) -> dict[str, float]:
    """The launcher's time inside the job, the training loop's, the samples, the job id."""
    job = json.loads((update / "slurm_job.json").read_text())
    manifest = read_manifest(update)
    return {"job_s": job["launcher_end"] - job["launcher_start"],
            "train_s": float(manifest.metrics.get("train_seconds") or 0.0),
            "samples": manifest.num_samples, "job_id": job["job_id"]}


def _round_row(wall: float, updates: dict[str, Path], extra: dict[str, Any]) -> dict[str, Any]:
    sites = {s: site_times(u) for s, u in updates.items()}
    slowest_job = max(t["job_s"] for t in sites.values())
    slowest_train = max(t["train_s"] for t in sites.values())
    return {"wall_s": wall, "sites": sites, "slowest_job_s": slowest_job,
            "overhead_s": wall - slowest_job, "overhead_vs_train_s": wall - slowest_train,
            **extra}


def run_xffl(job: Path, env: dict[str, str],
             sites: tuple[str, ...] = SITES) -> list[dict[str, Any]]:
    """Submit the job, wait for it, and read every round's times from the registry (and the
    coordinator's CPU seconds per round, :mod:`bench.round_overhead.cpu`)."""
    from xffl.jobs.registry.store import Registry

    sampler = cpu.CpuSampler(job.parent)
    sampler.start()
    try:
        status = json.loads(_xffl(env, "submit", str(job), "--wait", "--json",
                                  "--timeout", "1500"))
    finally:
        sampler.stop()
    if status["state"] != "completed":
        raise SystemExit(f"the xffl run ended {status['state']}: {status.get('message')}")
    run_dir = Path(status["run_dir"])
    registry = Registry(Path(env["XFFL_HOME"]) / "registry.db")
    rows = []
    submitted = registry.events(status["run_id"])[0][0]
    first = registry.rounds(status["run_id"])[0].started
    assert first is not None
    print(f"xffl: {first - submitted:.2f} s from submit to round 1 (supervisor start, initial "
          "model, StreamFlow set-up: once per run, not per round)", flush=True)
    for rnd in registry.rounds(status["run_id"]):
        assert rnd.started is not None and rnd.ended is not None
        updates = {s: run_dir / "rounds" / str(rnd.round) / "updates" / s for s in sites}
        rows.append(_round_row(rnd.ended - rnd.started, updates,
                               {"aggregate_s": rnd.aggregate_seconds or 0.0}))
    windows = [(submitted, first)] + [(r.started or 0.0, r.ended or 0.0)
                                      for r in registry.rounds(status["run_id"])]
    spent = sampler.per_round(windows)
    print(f"xffl: the coordinator's CPU seconds before round 1: {spent[0]['self']:.2f} "
          f"(supervisor), {spent[0]['steps']:.2f} (its children); per round:", flush=True)
    cpu.show(spent[1:])
    for row, used in zip(rows, spent[1:], strict=True):
        row["cpu_s"] = used
    print("xffl: each round, per site (seconds; breakdown.py):", flush=True)
    try:
        show(breakdown(run_dir))
    except (SystemExit, OSError, ValueError, KeyError) as exc:  # the overheads still count
        print(f"(no breakdown: {exc})", flush=True)
    return rows


def _scp(info: stack.StackInfo, cluster: str, src: str, dst: str) -> None:
    """scp -r over the cluster's login port (host key checked), as a user would."""
    c = info.clusters[cluster]
    argv = ["scp", "-q", "-r", "-F", "/dev/null", "-i", info.ssh_key, "-P", str(c.ssh_port),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={info.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            src.replace("@remote:", f"{info.user}@{info.host}:"),
            dst.replace("@remote:", f"{info.user}@{info.host}:")]
    subprocess.run(argv, check=True, timeout=300)


def _baseline_site(info: stack.StackInfo, plan: Path, work: Path, site: str, rnd: int,
                   model: Path, mode: str, poll: float) -> Path:
    """One site's round by hand: copy the model in, run the job, copy the update back."""
    remote = Path(info.clusters[site].work_dir) / mode / f"r{rnd}"
    # a fresh folder: scp -r into an existing model/ would nest the copy and leave a model of
    # an earlier run (another xffl's, even) where the job reads it
    info.ssh(site, f"rm -rf {remote} && mkdir -p {remote}", timeout=60, check=True)
    _scp(info, site, str(model), f"@remote:{remote}/model")
    submit = (f"cd {remote} && sbatch --parsable {plan / 'sbatch' / f'{site}.sh'} {rnd} "
              f"{remote}/model {plan / 'jobs' / f'{site}.json'} {remote}/update")
    if mode == "wait":
        command = submit.replace("sbatch --parsable", "sbatch --wait --parsable")
    else:
        # squeue answering nothing for a moment (a busy controller) is not the job's end:
        # an error keeps the loop polling; the job's record says how it ended, and is
        # printed when it did not complete
        command = (f"id=$({submit}) && while s=$(squeue -h -j $id -o %i 2>/dev/null || "
                   f"echo busy); [ -n \"$s\" ]; do sleep {poll:g}; done; "
                   "line=$(scontrol show -o job $id 2>&1); case \"$line\" in "
                   "*JobState=COMPLETED*) ;; *) echo \"$line\" >&2; exit 1;; esac")
    out = info.ssh(site, command, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"baseline ({mode}) job at {site} failed: {out.stderr}")
    local = work / mode / f"r{rnd}" / site
    local.parent.mkdir(parents=True, exist_ok=True)
    _scp(info, site, f"@remote:{remote}/update", str(local))
    return local


def run_baseline(plan: Path, info: stack.StackInfo, work: Path, rounds: int, mode: str,
                 poll: float, sites: tuple[str, ...] = SITES) -> list[dict[str, Any]]:
    """The hand-written loop: rendered scripts, scp, jobs in parallel, FedAvg."""
    model = plan / "rounds" / "0" / "global"
    rows = []
    with ThreadPoolExecutor(len(sites)) as pool:
        for rnd in range(1, rounds + 1):
            t0 = time.time()
            futures = {s: pool.submit(_baseline_site, info, plan, work, s, rnd, model, mode,
                                      poll) for s in sites}
            updates = {s: f.result() for s, f in futures.items()}
            target = work / mode / f"r{rnd}" / "global"
            t1 = time.perf_counter()
            run_strategy("fedavg", [updates[s] for s in sites], model, target,
                         weighting="samples", run_id=read_manifest(updates[sites[0]]).run_id,
                         round=rnd,
                         parent_digest=read_manifest(model).digest())
            aggregate = time.perf_counter() - t1
            rows.append(_round_row(time.time() - t0, updates, {"aggregate_s": aggregate}))
            model = target
    return rows


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def report(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print the per-round table and the overhead ratios; return the summary."""
    head = " | ".join(f"{m + ' wall':>10} {'job':>5} {'overhead':>8}" for m in results)
    print(f"{'round':>5} | {head}   (seconds; job: the slowest site's time in its job)")
    for i, rows in enumerate(zip(*results.values(), strict=True), 1):
        print(f"{i:>5} | " + " | ".join(
            f"{r['wall_s']:10.2f} {r['slowest_job_s']:5.2f} {r['overhead_s']:8.2f}"
            for r in rows))
    summary: dict[str, Any] = {
        "overhead_s": {m: _mean(rows, "overhead_s") for m, rows in results.items()},
        "max_overhead_s": {m: max(r["overhead_s"] for r in rows) for m, rows in results.items()},
        "overhead_vs_train_s": {m: _mean(rows, "overhead_vs_train_s")
                                for m, rows in results.items()},
    }
    xffl = summary["overhead_s"]["xffl"]
    summary["ratio"] = {m: xffl / v for m, v in summary["overhead_s"].items() if m != "xffl"}
    print(" mean | " + ", ".join(f"{m} {v:.2f} s" for m, v in summary["overhead_s"].items())
          + "".join(f"; xffl / {m} = {r:.2f}" for m, r in summary["ratio"].items())
          + f"; xffl's worst round {summary['max_overhead_s']['xffl']:.2f} s "
          "(target: <= 1.1 x poll)")
    print("      | wall - the slowest training loop (torch start-up counted as overhead too): "
          + ", ".join(f"{m} {v:.2f} s" for m, v in summary["overhead_vs_train_s"].items()))
    return summary


def main(argv: list[str] | None = None) -> int:
    """Bring the stack up, run xffl and the baseline, print the overheads and their ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="training steps per round and site")
    p.add_argument("--ranks", type=int, default=2, help="training ranks per site (srun -n)")
    p.add_argument("--polling-interval", type=float, default=1.0,
                   help="StreamFlow's squeue polling interval (the job spec's slurm override)")
    p.add_argument("--baselines", default="wait,poll", help="wait (sbatch --wait), poll "
                   "(squeue every polling interval), both: wait,poll, or none: ''")
    p.add_argument("--sites", type=int, default=len(SITES), choices=range(1, len(SITES) + 1),
                   help="the first N of the test clusters (alpha, beta; default both)")
    p.add_argument("--stack-dir", type=Path, default=None, help="default: the tests' stack dir")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
    args = p.parse_args(argv)

    info = stack.up(args.stack_dir or stack.default_dir())
    work = Path(tempfile.mkdtemp(prefix="xffl-bench-rounds-"))
    env = {**os.environ, "XFFL_HOME": str(work / "home"), "HOME": info.ssh_home,
           "XDG_CONFIG_HOME": str(work / "config")}
    os.environ.update(XFFL_HOME=env["XFFL_HOME"])
    sites = SITES[:args.sites]
    try:
        job = write_job(work, info, args.rounds, args.steps, args.polling_interval,
                        args.ranks, sites)
        print(f"{args.rounds} rounds of {args.steps} steps, {len(sites)} sites x {args.ranks} "
              "ranks (srun), "
              f"polling {args.polling_interval:g} s, {os.cpu_count()} CPUs; work dir {work}",
              flush=True)
        t0 = time.perf_counter()
        xffl = run_xffl(job, env, sites)
        print(f"xffl: {time.perf_counter() - t0:.1f} s in all (submit to completed)", flush=True)
        results = {"xffl": xffl}
        plan = work / "plan"
        _xffl(env, "render", str(job), "-o", str(plan))
        for mode in filter(None, args.baselines.split(",")):
            t0 = time.perf_counter()
            results[mode] = run_baseline(plan, info, work, args.rounds, mode,
                                         args.polling_interval, sites)
            print(f"{mode}: {time.perf_counter() - t0:.1f} s in all", flush=True)
        summary = report(results)
        if args.json:
            print(json.dumps({"rounds": results, **summary}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
