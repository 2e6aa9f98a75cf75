"""Benchmark: a site's update save at Llama-3.1-8B width, whole state dict against streamed.

A model at Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32 heads over 8 kv heads, the
128256-token vocabulary; ``--layers`` decoder layers, 1 by default, the head tied unless
``--untied``) is sharded by FSDP2 over two gloo ranks (torchrun's agent, the ranks forked from
one interpreter that imported torch: :mod:`xffl.training.forked`, as a CPU site starts them), as
a site at dp 2 holds it after training, and its fp32 update is saved two ways, each in a fresh
launch:

- ``whole`` (the baseline, the save before streaming): torch's ``get_model_state_dict``
  (full state dict, CPU offload) gathers every tensor into rank 0's memory, safetensors'
  ``save_file`` writes it, then every file is read back for its sha256;
- ``streamed`` (:mod:`xffl.training.update_save`): one tensor at a time sent to rank 0,
  written through the sharded writer, hashed while written.

Printed per way: the save's seconds on rank 0 (from the first gather to the manifest, both
ranks waited for), rank 0's peak RSS during the save above its RSS before (VmHWM, reset just
before), and the ratios whole / streamed measured in the same invocation; the two updates
must be the same bytes (the same sha256 of every file).

    .venv/bin/python bench/save_update/run.py                 # 1 layer: 3.0 GB
    .venv/bin/python bench/save_update/run.py --layers 4 --untied --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WAYS = ("whole", "streamed")
WIDTH = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
         "num_attention_heads": 32, "num_key_value_heads": 8}
TINY = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 1000,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def warm_imports(argv: list[str]) -> None:
    """What a rank imports, imported once before the ranks are forked (xffl.training.forked)."""
    import torch.distributed  # noqa: F401

    import xffl.training.parallelize
    import xffl.training.update_save  # noqa: F401


def worker(way: str, out: Path, overrides: dict[str, Any]) -> None:
    """One rank: the sharded model, then one save ``way``; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist

    from xffl.aggregator.exchange import Manifest
    from xffl.aggregator.exchange_spec import ExchangeSpec
    from xffl.training.arch import build_config
    from xffl.training.checkpoint import save_checkpoint
    from xffl.training.config import ModelSpec
    from xffl.training.model import build_model
    from xffl.training.parallelize import parallelize
    from xffl.training.update_save import drain, gather_tensors, save_update

    dist.init_process_group("gloo")
    config = build_config(ModelSpec(preset="llama3.1-8b", overrides=overrides))
    with torch.device("meta"):
        model = build_model(config)
    pm = parallelize(model, 1, torch.device("cpu"), "fsdp")  # each rank allocates its half
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.01)
    shapes, gathered = gather_tensors(pm)
    manifest = Manifest(kind="update", run_id="bench", round=1, site="a")
    main = dist.get_rank() == 0
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    began = time.perf_counter()
    if way == "whole":
        state = pm.full_state_dict()
        if main:
            save_checkpoint(state, config, out, manifest)
        del state
    elif main:
        save_update(gathered, shapes, config.to_json(), out, manifest, ExchangeSpec(), out)
    else:
        drain(gathered)
    dist.barrier()
    seconds = time.perf_counter() - began
    if main:
        print(json.dumps({"way": way, "seconds": seconds, "before": before,
                          "peak": _status("VmHWM"),
                          "bytes": sum(4 * math.prod(s) for s in shapes.values()),
                          "largest": max(4 * math.prod(s) for s in shapes.values())}),
              flush=True)
    dist.destroy_process_group()


def launch(way: str, out: Path, overrides: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One save ``way`` by two gloo ranks under torchrun's agent (forked); rank 0's
    measurements."""
    from xffl.training.launch import rank_python_words  # (it imports no torch)

    python = rank_python_words(os.environ) or [sys.executable]  # as the launcher's ranks
    cmd = [*python, "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
           "bench.save_update.run", "--worker", way, "--out", str(out),
           "--overrides", json.dumps(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{way}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


def run(overrides: dict[str, Any], work: Path, timeout: float = 1800) -> dict[str, Any]:
    """Both ways in turn; the updates compared file by file, then removed."""
    from xffl.aggregator.exchange import verify_checkpoint

    rows: dict[str, dict[str, Any]] = {}
    files: dict[str, dict[str, str]] = {}
    for way in WAYS:
        out = work / way
        rows[way] = launch(way, out, overrides, timeout)
        files[way] = verify_checkpoint(out).files
        shutil.rmtree(out)
    whole, streamed = rows["whole"], rows["streamed"]
    return {"overrides": overrides, "bytes": whole["bytes"], "largest": whole["largest"],
            "rows": rows, "same_bytes": files["whole"] == files["streamed"],
            "seconds_ratio": whole["seconds"] / streamed["seconds"],
            "rise_ratio": (whole["peak"] - whole["before"])
            / max(1, streamed["peak"] - streamed["before"])}


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table, with the ratios below it."""
    gib = 2**30
    lines = [f"update: {result['bytes'] / 1e9:.2f} GB fp32 ({result['bytes'] / gib:.2f} GiB),"
             f" largest tensor {result['largest'] / gib:.2f} GiB; same bytes both ways: "
             f"{result['same_bytes']}",
             "",
             "| save | seconds | GB/s | rank-0 RSS rise GiB | rank-0 peak GiB |",
             "|---|---:|---:|---:|---:|"]
    for way, row in result["rows"].items():
        lines.append(f"| {way} | {row['seconds']:.1f} | {row['bytes'] / 1e9 / row['seconds']:.2f}"
                     f" | {(row['peak'] - row['before']) / gib:.2f} | {row['peak'] / gib:.2f} |")
    lines.append("")
    lines.append(f"whole / streamed: {result['seconds_ratio']:.2f}x the seconds, "
                 f"{result['rise_ratio']:.2f}x the RSS rise")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one rank of it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    parser.add_argument("--untied", action="store_true", help="an LM head of its own")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--work", type=Path, default=None, help="folder for the updates")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out, json.loads(args.overrides))
        return 0
    overrides = {**(TINY if args.tiny else WIDTH), "num_hidden_layers": args.layers,
                 "tie_word_embeddings": not args.untied, "max_position_embeddings": 2048}
    with tempfile.TemporaryDirectory(prefix="xffl-save-bench-",
                                     dir=args.work) as work:
        result = run(overrides, Path(work))
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if result["same_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
