"""Benchmark: a checkpoint inside a round (training.checkpoint) at Llama-3.1-8B width, on CPU.

A model at Llama-3.1-8B's widths (hidden 4096, MLP 14336, 32 heads over 8 kv heads;
``--layers`` decoder layers, 1 by default; ``--vocab`` tokens, 128256 by default, the head
tied) is sharded by FSDP2 over two gloo ranks (forked from one interpreter, as a CPU site
starts them) with its AdamW state, after a few training steps. In one launch, measured on
rank 0 with both ranks waiting for each other:

- ``step``: seconds of one training step (batch 1 x ``--seq`` tokens, AdamW), the
  baseline every other number is divided by;
- ``sync save``: ``dcp.save`` of the same state (what a save that training waits for costs);
- ``async save``: :class:`xffl.training.round_state.RoundCheckpointer`'s save, the seconds
  training waits (``blocked``: its state dict and the copy dcp stages) and until its
  ``complete`` marker is written (the files' sha256 included);
- ``load``: :func:`xffl.training.round_state.newest_complete` (the files' sha256 checked)
  and :func:`~xffl.training.round_state.restore`.

Printed: seconds, bytes, GB/s, the ratios to a step, and the fraction of a round a
checkpoint every ``--every`` steps (default 100) costs the training: blocked / (every x step).

    .venv/bin/python bench/round_checkpoint/run.py                # 1 layer
    .venv/bin/python bench/round_checkpoint/run.py --layers 2 --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WIDTH = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2}


def warm_imports(argv: list[str]) -> None:
    """What a rank imports, imported once before the ranks are forked (xffl.training.forked)."""
    import torch.distributed.checkpoint  # noqa: F401

    import xffl.training.parallelize
    import xffl.training.round_state  # noqa: F401


def _train_step(pm: Any, optimizer: Any, vocab: int, seq: int) -> float:
    """One AdamW step on random tokens; its seconds (both ranks waited for)."""
    import torch
    import torch.distributed as dist

    tokens = torch.randint(0, vocab, (1, seq + 1))
    dist.barrier()
    began = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    out = pm.net(tokens[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    dist.barrier()
    return time.perf_counter() - began


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def worker(out: Path, overrides: dict[str, Any], seq: int) -> None:
    """One rank: the sharded model and optimizer, then each measurement; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.optim.lr_scheduler import LambdaLR

    from xffl.training import distributed as xdist
    from xffl.training import round_state
    from xffl.training.arch import build_config
    from xffl.training.config import ModelSpec, RoundCheckpointSpec, TrainingSpec
    from xffl.training.model import build_model
    from xffl.training.optimizer import make_optimizer
    from xffl.training.parallelize import parallelize

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = build_config(ModelSpec(preset="llama3.1-8b", overrides=overrides))
    with torch.device("meta"):
        model = build_model(config)
    pm = parallelize(model, 1, torch.device("cpu"), "fsdp", precision="fp32")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
    optimizer = make_optimizer(pm.module, TrainingSpec())
    scheduler = LambdaLR(optimizer, lambda s: 1.0)
    vocab = int(overrides["vocab_size"])
    _train_step(pm, optimizer, vocab, seq)  # warm-up: the AdamW state exists after it
    step = min(_train_step(pm, optimizer, vocab, seq) for _ in range(2))
    main = dist.get_rank() == 0

    sync_dir = out / "sync"
    if main:
        sync_dir.mkdir(parents=True)
    dist.barrier()
    began = time.perf_counter()
    model_sd, optim_sd = get_state_dict(pm.module, optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(sync_dir))
    dist.barrier()
    sync = time.perf_counter() - began
    del model_sd, optim_sd

    want = round_state.Identity("bench", 1, "0" * 64, dist.get_world_size())
    saver = round_state.RoundCheckpointer(RoundCheckpointSpec(every=1, keep=1), out, want, 1)
    losses = torch.zeros(3, dtype=torch.float64)
    dist.barrier()
    began = time.perf_counter()
    blocked = saver.save(3, pm, optimizer, scheduler, losses, 0)
    saver.wait()
    dist.barrier()
    written = time.perf_counter() - began
    saver.close()

    dist.barrier()
    began = time.perf_counter()
    found = round_state.newest_complete(out, want) if main else None
    chosen = xdist.broadcast_str(None if found is None else json.dumps(
        {"path": str(found.path), "step": found.step, "marker": found.marker}))
    assert chosen is not None
    data = json.loads(chosen)
    round_state.restore(round_state.Found(Path(data["path"]), data["step"], data["marker"]),
                        pm, optimizer, scheduler)
    dist.barrier()
    load = time.perf_counter() - began
    if main:
        print(json.dumps({"step": step, "sync": sync, "sync_bytes": _bytes(sync_dir),
                          "blocked": blocked, "written": written,
                          "bytes": _bytes(Path(data["path"])), "load": load,
                          "parameters": sum(p.numel() for p in pm.module.parameters())}),
              flush=True)
    dist.destroy_process_group()


def run(overrides: dict[str, Any], work: Path, seq: int = 128, every: int = 100,
        timeout: float = 3600) -> dict[str, Any]:
    """One launch of two ranks; the measurements and their ratios to a training step."""
    cmd = [sys.executable, "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
           "bench.round_checkpoint.run", "--worker", "--out", str(work), "--seq", str(seq),
           "--overrides", json.dumps(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads([x for x in proc.stdout.splitlines()
                                      if x.startswith("{")][-1])
    step = row["step"]
    return {"overrides": overrides, "seq": seq, "every": every, **row,
            "sync_per_step": row["sync"] / step, "blocked_per_step": row["blocked"] / step,
            "written_per_step": row["written"] / step, "load_per_step": row["load"] / step,
            "round_fraction": row["blocked"] / (every * step),
            "round_fraction_sync": row["sync"] / (every * step)}


def table(r: dict[str, Any]) -> str:
    """The result as a markdown table, with the ratios below it."""
    gb = 1e9
    lines = [f"model: {r['parameters'] / 1e6:.0f} M parameters ({r['overrides']}), FSDP2 over "
             f"2 gloo ranks; a step: batch 1 x {r['seq']} tokens, {r['step']:.2f} s",
             "",
             "| what | seconds | GB | GB/s | / step |",
             "|---|---:|---:|---:|---:|",
             f"| sync save (dcp.save) | {r['sync']:.2f} | {r['sync_bytes'] / gb:.2f} | "
             f"{r['sync_bytes'] / gb / r['sync']:.2f} | {r['sync_per_step']:.2f} |",
             f"| async save: training waits | {r['blocked']:.2f} | {r['bytes'] / gb:.2f} | | "
             f"{r['blocked_per_step']:.2f} |",
             f"| async save: until complete | {r['written']:.2f} | {r['bytes'] / gb:.2f} | "
             f"{r['bytes'] / gb / r['written']:.2f} | {r['written_per_step']:.2f} |",
             f"| load (sha256 checked) | {r['load']:.2f} | {r['bytes'] / gb:.2f} | "
             f"{r['bytes'] / gb / r['load']:.2f} | {r['load_per_step']:.2f} |",
             "",
             f"a checkpoint every {r['every']} steps costs the round "
             f"{100 * r['round_fraction']:.2f}% (async; {100 * r['round_fraction_sync']:.2f}% "
             "if training waited for dcp.save)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one rank of it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (default 128256)")
    parser.add_argument("--seq", type=int, default=128, help="tokens of a step (default 128)")
    parser.add_argument("--every", type=int, default=100,
                        help="steps between checkpoints the fraction is given for")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke test)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--overrides", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.out, json.loads(args.overrides), args.seq)
        return 0
    overrides = {**(TINY if args.tiny else WIDTH), "num_hidden_layers": args.layers,
                 "vocab_size": 1000 if args.tiny else args.vocab, "tie_word_embeddings": True,
                 "max_position_embeddings": 2048}
    with tempfile.TemporaryDirectory(prefix="xffl-ckpt-bench-", dir=args.work) as work:
        result = run(overrides, Path(work), args.seq, args.every)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
