"""Benchmark: the CPU a process spends importing torch and transformers and exiting again.

Every round, every site's ranks start Python processes that import torch and transformers,
and the coordinator starts one or more per site for its own steps. ``xffl.core.startup``'s
``collect_less()``, which each of them calls first, does two things about the heap those
imports build: it collects the youngest generation less often while they run, and it freezes
the heap at exit, so that the interpreter's final full collections skip it. Each variant
below runs in a new process, N times, the variants alternated so that machine noise spreads
evenly; its CPU-seconds (user + system, the kernel's accounting of that child) and wall
seconds are summarised by their medians:

- ``python -c pass``: the interpreter alone, which nothing beats;
- ``imports, CPython defaults``: the baseline, ``import torch`` and transformers' Llama;
- ``imports, threshold only``: the same after raising the first generation's threshold as
  collect_less() does, without the freeze at exit;
- ``imports, collect_less()``: the same after collect_less(), as every xffl process;
- ``a training round``: ``python -m xffl.training`` on the tiny-test preset, 3 steps, one
  rank (start-up, a round too small to matter, the update written, exit).

It prints each median and the ratios of the import variants' CPU to the baseline's.
Target: ``imports, collect_less()`` at most 0.85x the baseline's CPU.

    python bench/startup/run.py            # 7 repetitions
    python bench/startup/run.py -n 3 --json
    python bench/startup/run.py -n 1 --imports json   # the harness alone, in seconds
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

TARGET = 0.85
HEAVY = "torch, transformers.models.llama.modeling_llama"
BASELINE = "imports, CPython defaults"


def _variants(imports: str, work: Path) -> dict[str, list[str]]:
    """Each variant's command line."""
    python = sys.executable
    threshold = ("import gc; from xffl.core.startup import YOUNG; "
                 "gc.set_threshold(YOUNG, *gc.get_threshold()[1:]); ")
    return {
        "python -c pass": [python, "-c", "pass"],
        BASELINE: [python, "-c", f"import {imports}"],
        "imports, threshold only": [python, "-c", f"{threshold}import {imports}"],
        "imports, collect_less()": [python, "-c", "from xffl.core.startup import collect_less; "
                                    f"collect_less(); import {imports}"],
        "a training round": [python, "-m", "xffl.training", "--job", str(work / "job.json"),
                             "--round", "1", "--model", str(work / "global0"), "--out"],
    }


def _round_inputs(work: Path) -> None:
    """The training round's job (tiny-test preset, synthetic data) and round-0 global."""
    from xffl.training.checkpoint import init_global
    from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob

    job = TrainJob(run_id="bench-startup", site="site-a", model=ModelSpec(preset="tiny-test"),
                   training=TrainingSpec(steps=3, batch_size=2, seq_len=16, seed=0),
                   data=DataSpec(path=str(work / "data"), synthetic="alpha",
                                 synthetic_sequences=8))
    (work / "job.json").write_text(job.model_dump_json())
    init_global("bench-startup", job.model, 0, work / "global0")


def _measure(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """CPU-seconds (user + system) and wall seconds of one run of ``argv``."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert child.stderr is not None
    err = child.stderr.read()  # (read before waiting: a full pipe would block the child)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stderr.close()
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({child.returncode}): {err[-500:]!r}")
    return usage.ru_utime + usage.ru_stime, wall


def run(repeat: int, imports: str) -> dict[str, object]:
    """Every variant ``repeat`` times, alternated; their medians and ratios."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="xffl-startup-bench-") as tmp:
        work = Path(tmp)
        _round_inputs(work)
        variants = _variants(imports, work)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for i in range(repeat):
            for name, argv in variants.items():
                if name == "a training round":
                    argv = [*argv, str(work / f"update-{i}")]
                runs[name].append(_measure(argv, env))
    cpu = {name: statistics.median(c for c, _ in rows) for name, rows in runs.items()}
    wall = {name: statistics.median(w for _, w in rows) for name, rows in runs.items()}
    ratios = {name: cpu[name] / cpu[BASELINE]
              for name in ("imports, threshold only", "imports, collect_less()")}
    return {"repeat": repeat, "imports": imports, "cpu_s": cpu, "wall_s": wall,
            "runs": runs, "ratio": ratios, "target": TARGET}


def render(result: dict[str, object]) -> str:
    """The table and the ratio lines."""
    cpu, wall = result["cpu_s"], result["wall_s"]
    assert isinstance(cpu, dict) and isinstance(wall, dict)
    lines = [f"median of {result['repeat']} runs each (imports: {result['imports']})",
             f"{'variant':<28} {'CPU s':>8} {'wall s':>8}"]
    lines += [f"{name:<28} {cpu[name]:8.3f} {wall[name]:8.3f}" for name in cpu]
    ratio = result["ratio"]
    assert isinstance(ratio, dict)
    lines += [f"{name} / {BASELINE}: {value:.2f}x CPU" for name, value in ratio.items()]
    met = ratio["imports, collect_less()"] <= TARGET
    lines.append(f"target: collect_less() <= {TARGET:.2f}x the baseline's CPU: "
                 f"{'met' if met else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure every variant; print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=7, help="repetitions of each variant")
    parser.add_argument("--imports", default=HEAVY,
                        help=f"what the import variants import (default: {HEAVY})")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.n, args.imports)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
