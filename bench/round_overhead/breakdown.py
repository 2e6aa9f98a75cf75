"""Where a SLURM run's round goes, per round and per site, from its ``streamflow.log`` and jobs.

Each phase is the time between two things the run records: StreamFlow's log lines (a step
executing, a job scheduled, a copy completed, the admit and aggregate steps' own lines) and
the launcher's start and end inside each job (``update/slurm_job.json``). Per site:

  out      the round's start (the previous aggregate's line; the run's first EXECUTING line
           in round 1) to ``sbatch`` returning: copies of the global model and job file, sbatch
  queue    sbatch to the launcher starting in the job: SLURM's scheduling, bash, Python
  job      the launcher's own time (torch start-up, training, saving): not overhead
  back     the launcher's end to the update copied back: squeue's poll noticing the job gone,
           StreamFlow's scontrol calls, the copy
  admit    the admit step's process (checks of the update on the coordinator), from the copy
           back to its verdict line, StreamFlow's scheduling of the step included

Per round: ``agg`` (the last admission to the aggregate step's line: that step's process and
StreamFlow's scheduling of it). A round's overhead on the critical path is everything but the
slowest site's ``job``.

    python bench/round_overhead/breakdown.py RUN_DIR
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
PHASES = ("out", "queue", "job", "back", "admit")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    return time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000


def events(log: Path) -> list[tuple[float, str]]:
    """The log's timestamped lines, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        t = _stamp(line)
        if t is not None:
            out.append((t, line[24:]))
    return out


def _first(lines: list[tuple[float, str]], pattern: str, after: float = 0.0) -> float | None:
    rx = re.compile(pattern)
    return next((t for t, text in lines if t >= after and rx.search(text)), None)


def round_phases(run_dir: Path, rnd: int, sites: list[str],
                 lines: list[tuple[float, str]], start: float) -> dict[str, object]:
    """One round's phases per site (seconds) and its aggregate's, from ``start``."""
    k = rnd - 1
    per_site: dict[str, dict[str, float]] = {}
    for site in sites:
        job = json.loads((run_dir / "rounds" / str(rnd) / "updates" / site
                          / "slurm_job.json").read_text())
        sched = _first(lines, rf"Scheduled job /rounds/train_{site}/0\.{k} ", start)
        back = _first(lines, rf"COMPLETED copy from '.*/update' on location login-{site}/",
                      job["launcher_end"])
        admitted = _first(lines, rf"^INFO +round {rnd}: site {site} ", start)
        if sched is None or back is None or admitted is None:
            raise SystemExit(f"{run_dir}: round {rnd}, site {site}: a line is missing")
        per_site[site] = {"out": sched - start, "queue": job["launcher_start"] - sched,
                          "job": job["launcher_end"] - job["launcher_start"],
                          "back": back - job["launcher_end"], "admit": admitted - back}
    last_admit = max(start + sum(p[x] for x in PHASES) for p in per_site.values())
    aggregated = _first(lines, rf"^INFO +round {rnd}: aggregated ", start)
    if aggregated is None:
        raise SystemExit(f"{run_dir}: round {rnd}: no aggregate line")
    slowest = max(p["job"] for p in per_site.values())
    return {"sites": per_site, "agg": aggregated - last_admit, "end": aggregated,
            "wall": aggregated - start, "overhead": aggregated - start - slowest}


def breakdown(run_dir: Path) -> list[dict[str, object]]:
    """Every round's phases, the rounds chained by their aggregate lines."""
    run = json.loads((run_dir / "job.json").read_text())
    sites = [s["name"] for s in run["sites"]]
    lines = events(run_dir / "streamflow.log")
    start = _first(lines, r"EXECUTING step ")
    rows = []
    for rnd in range(1, int(run["rounds"]) + 1):
        if not (run_dir / "rounds" / str(rnd) / "updates").is_dir() or start is None:
            break
        row = round_phases(run_dir, rnd, sites, lines, start)
        rows.append(row)
        start = float(row["end"])  # type: ignore[arg-type]
    return rows


def show(rows: list[dict[str, object]]) -> None:
    """Print one line per round and site, and the round's aggregate and overhead."""
    print("round site   " + " ".join(f"{p:>6}" for p in PHASES) + "    agg   wall overhead")
    for rnd, row in enumerate(rows, 1):
        sites: dict[str, dict[str, float]] = row["sites"]  # type: ignore[assignment]
        for i, (site, p) in enumerate(sites.items()):
            tail = (f" {row['agg']:6.2f} {row['wall']:6.2f} {row['overhead']:8.2f}"
                    if i == len(sites) - 1 else "")
            print(f"{rnd:>5} {site:<6} " + " ".join(f"{p[x]:6.2f}" for x in PHASES) + tail)


if __name__ == "__main__":
    show(breakdown(Path(sys.argv[1])))
