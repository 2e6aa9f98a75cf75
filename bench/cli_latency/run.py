"""Benchmark: how long the everyday commands take, as whole processes, against the interpreter.

Each command runs as a user runs it (a new process: interpreter start, imports, the work,
exit), N times, alternating commands so that machine noise spreads evenly; the medians are
printed with their ratio to the baseline measured in the same invocation: ``python -c pass``
(the interpreter's own start, which no command can beat) and ``python -c "import typer,
rich"`` (the CLI toolkit alone). A run of the quickstart's job spec is registered first
(``xffl submit --no-start``, nothing trained), so ``status``, ``logs`` and ``runs`` have a run
to show. Targets: ``xffl --help`` and ``xffl status last`` at most 0.4 s median.

    python bench/cli_latency/run.py            # 9 repetitions
    python bench/cli_latency/run.py -n 15 --json
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

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 0.4


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=120, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-500:]!r}")
    return elapsed


def main() -> int:
    """Time every command; print medians and ratios (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=9, help="repetitions of each command")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    python = sys.executable
    xffl = str(Path(python).with_name("xffl"))
    with tempfile.TemporaryDirectory(prefix="xffl-cli-bench-") as home:
        env = {**os.environ, "XFFL_HOME": home, "XDG_CONFIG_HOME": f"{home}/config"}
        job = str(REPO / "examples" / "quickstart.yaml")
        subprocess.run([xffl, "submit", job, "--no-start"], env=env, check=True,
                       stdout=subprocess.DEVNULL, timeout=120)
        commands = {
            "python -c pass (baseline)": [python, "-c", "pass"],
            "import typer, rich (baseline)": [python, "-c", "import typer, rich.console"],
            "xffl --help": [xffl, "--help"],
            "xffl status last": [xffl, "status", "last"],
            "xffl runs": [xffl, "runs"],
            "xffl logs last": [xffl, "logs", "last"],
            "xffl profiles list": [xffl, "sites", "list"],
            "xffl validate quickstart": [xffl, "validate", job],
            "import xffl.cli.app": [python, "-c", "import xffl.cli.app"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.n):
            for name, argv in commands.items():
                times[name].append(_time(argv, env))
    medians = {name: statistics.median(t) for name, t in times.items()}
    floor = medians["python -c pass (baseline)"]
    rows = [{"command": name, "median_s": round(m, 4), "min_s": round(min(times[name]), 4),
             "vs_python": round(m / floor, 2)} for name, m in medians.items()]
    verdicts = {name: medians[name] <= TARGET_S for name in ("xffl --help", "xffl status last")}
    if args.json:
        print(json.dumps({"repetitions": args.n, "rows": rows, "target_s": TARGET_S,
                          "within_target": verdicts}, indent=2))
        return 0
    print(f"{'command':32} {'median s':>9} {'min s':>7} {'x python':>9}")
    for row in rows:
        print(f"{row['command']:32} {row['median_s']:9.3f} {row['min_s']:7.3f} "
              f"{row['vs_python']:9.2f}")
    for name, ok in verdicts.items():
        print(f"{name}: {medians[name]:.3f} s median (target <= {TARGET_S} s: "
              f"{'met' if ok else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
