"""The one-GPU check: xffl's CUDA path proved on one H100/H200, each step under its timeout.

    python bench/gpu_check/run.py                  # on the GPU machine (about 7 minutes)
    python bench/gpu_check/run.py --cpu-dry-run    # the same steps at tiny shapes, on CPUs

Steps (bench/gpu_check/steps.py), in priority order, each a process of its own on the GPU, so
that a hang or a crash costs only its step (the CPU dry run's tiny steps share one process,
one import of torch instead of six):

  init    round 0 of a Llama-3.2-1B-shaped model (1.24 B, 128K vocabulary) and of a 3 M one
  dense   (a, b) a bf16 round of the 1B model through ``xffl.training.launch``: the loss
          falls; tokens/s per GPU, TFLOP/s, MFU and peak memory from the update's manifest
  admit   (c) that update admitted and aggregated by the coordinator's own code
  parity  (c) the 3 M model's fp32 round on the GPU against the same round on the CPU
  fsdp1   (d) FSDP2 + activation checkpointing on a one-rank NCCL group: the sharded load
          equals the checkpoint, ``train_round`` trains, the update is admitted
  lora    (e) an 8B LoRA round (r 16 on q, k, v, o) on a seeded base: memory, tokens/s, MFU

What one GPU cannot show: NCCL collectives across ranks, tensor parallelism on GPUs, FSDP2's
sharding memory at dp > 1 (docs/large-models.md says so too).

The GPU machine has torch but not all of xffl's dependencies and no network: wheels carried
beside this script (``bench/gpu_check/wheels``, filled by ``wheels.sh``) are installed with
``pip --no-index --no-deps --target`` under ``build/gpu_check``, and xffl runs from the tree
through a folder of symlinks that maps ``xffl.<pkg>`` to ``<pkg>/`` as pyproject does.
Results: ``OUT/<step>.json``, ``OUT/summary.json`` and one line per step on stdout
(OUT: ``--out``, else ``$OUT``, else ``build/gpu_check/out``). Exit 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD = REPO / "build" / "gpu_check"
WHEELS = HERE / "wheels"

# (step, timeout on the GPU in seconds): about 7 minutes when nothing hangs, 9 at most
STEPS = (("init", 90), ("dense", 120), ("admit", 45), ("parity", 75), ("fsdp1", 75),
         ("lora", 135))
DRY_TIMEOUT = 240  # a tiny step on a loaded 2-core machine


def _missing(python: str, env: dict[str, str], code: str) -> bool:
    """Whether ``code`` fails in ``python`` under ``env``."""
    return subprocess.run([python, "-c", code], env=env, capture_output=True,
                          check=False).returncode != 0


def environment(python: str) -> dict[str, str]:
    """The step processes' environment: carried wheels and the xffl tree when needed."""
    env = dict(os.environ)
    paths: list[str] = []
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if wheels and _missing(python, env, "import pydantic, transformers.initialization"):
        site = BUILD / "site"
        if not site.is_dir():
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                            "--target", str(site), *map(str, wheels)], check=True)
        paths.append(str(site))
    if _missing(python, env, "import xffl.training"):
        tree = BUILD / "pkg" / "xffl"
        tree.mkdir(parents=True, exist_ok=True)
        packages = subprocess.run([python, str(REPO / "scripts" / "packages.py")], check=True,
                                  capture_output=True, text=True).stdout.split()
        for pkg in packages:
            link = tree / pkg
            if not link.is_symlink():
                link.symlink_to(REPO / pkg)
        paths.append(str(tree.parent))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    return env


def _line(step: str, result: dict[str, Any]) -> str:
    """One summary line of a step's result."""
    keys = ("loss_drop", "loss_gap", "max_weight_gap", "sharded_load_exact", "fsdp_units",
            "loss_gap_vs_plain", "round_peak_gib", "estimate_gib", "aggregate_s", "wall_s",
            "error")
    shown = {k: result[k] for k in keys if k in result}
    metrics = result.get("metrics") or {}
    for k in ("tokens_per_s_per_gpu", "tflops", "mfu", "peak_memory_gib", "save_seconds"):
        if k in metrics:
            shown[k] = metrics[k]
    measured = metrics.get("peak_memory_gib", result.get("round_peak_gib"))
    if measured and result.get("estimate_gib"):  # the memory model against the measurement
        shown["measured_over_model"] = round(measured / result["estimate_gib"], 3)
    verdict = "PASS" if result.get("ok") else "FAIL"
    return f"gpu_check {step:<6} {verdict} " + json.dumps(shown, default=str)[:600]


def main(argv: list[str] | None = None) -> int:
    """Run the steps, print one line each, write the summary."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="the same steps at tiny shapes on the CPU (the test suite's run)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None,
                        help="scratch folder for checkpoints and data (default build/gpu_check)")
    parser.add_argument("--steps", default=",".join(s for s, _ in STEPS),
                        help="comma-separated subset, in the order given")
    args = parser.parse_args(argv)
    mode = "dry" if args.cpu_dry_run else "full"
    out = args.out or Path(os.environ.get("OUT") or BUILD / "out")
    work = args.work or BUILD / f"work-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    env = environment(python)
    if mode == "dry":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path even where a GPU is present
    timeouts = dict(STEPS)
    steps = args.steps.split(",")
    # the dry run's steps in one process (nothing there to isolate); on the GPU one each
    batches = [steps] if mode == "dry" else [[step] for step in steps]
    summary: dict[str, Any] = {"mode": mode}
    for batch in batches:
        timeout = DRY_TIMEOUT * len(batch) if mode == "dry" else timeouts[batch[0]]
        for step in batch:
            (out / f"{step}.json").unlink(missing_ok=True)
        try:
            proc = subprocess.run(
                [python, str(HERE / "steps.py"), ",".join(batch), "--mode", mode, "--work",
                 str(work), "--out", str(out)], env=env, capture_output=True, text=True,
                check=False, timeout=timeout)
            failure = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout} s"
        for step in batch:
            result_file = out / f"{step}.json"
            result = json.loads(result_file.read_text()) if result_file.is_file() else {
                "ok": False, "error": failure}
            summary[step] = result
            print(_line(step, result), flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0 if all(summary[s].get("ok") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
