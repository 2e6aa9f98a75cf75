"""Benchmark: tokens/s of xffl's training loop against a minimal plain-PyTorch loop.

Both train the same model (same seed) on the same batches in the same order, and the run
checks that their loss curves agree (torchtitan's proof by loss-curve equality), so the
ratio compares equal work:

  plain  the textbook loop over batches materialized in memory beforehand: zero_grad,
         forward, cross-entropy, backward, clip_grad_norm_, AdamW step
  xffl   xffl.training.loop.run_steps (the loop train_round runs) reading the token shards
         through xffl's sampler, with its scheduler, accounting and parallel wrapper

Trials alternate (plain, xffl, plain, ...) after warm-up steps; the median of each is
reported with the ratio xffl / plain. On CUDA both use bf16 autocast, and the model FLOPs
utilisation (6 N + 12 L d S FLOPs per token, PaLM's estimate) is printed against the GPU's
peak. Launched under torchrun the ranks form a process group (NCCL on GPUs) and xffl's loop
runs under DDP, the plain loop under torch's DDP too.

    python bench/train_throughput/run.py                       # CPU, a ~3 M-parameter model
    torchrun --nproc-per-node 1 bench/train_throughput/run.py --device cuda --size 1b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from xffl.training import distributed as xdist
from xffl.training.arch import apply_overrides, build_config
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.data import TokenShards, ensure_synthetic
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import ModelConfig, build_model, from_config, num_parameters
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize
from xffl.training.telemetry import flop_params, flops_per_token, peak_tflops

SIZES: dict[str, dict[str, int]] = {
    # ~3 M parameters: big enough that compute, not Python, dominates on a CPU core
    "small": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 1024},
    # ~1.1 B parameters (TinyLlama-like shape) for GPUs
    "1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
           "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
           "max_position_embeddings": 4096},
}


def _config(size: str) -> ModelConfig:
    return apply_overrides(build_config(ModelSpec(preset="tiny")), SIZES[size])


def _plain_setup(model: torch.nn.Module, spec: TrainingSpec,
                 device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model as called (DDP under a process group) and AdamW as xffl's (decay on matrices)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=spec.adam_eps)
    net: torch.nn.Module = model
    if dist.is_initialized():
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    return net, opt


def _plain(net: torch.nn.Module, opt: torch.optim.Optimizer, spec: TrainingSpec,
           batches: list[tuple[torch.Tensor, ...]], device: torch.device) -> list[float]:
    """The textbook loop: zero_grad, forward, cross-entropy, backward, clip, step."""
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x)
        else:
            logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), spec.grad_clip)
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def trial(mode: str, config: ModelConfig, spec: TrainingSpec, shards: TokenShards,
          warmup: int, steps: int, device: torch.device, rank: int,
          world: int) -> tuple[float, list[float]]:
    """Seconds of ``steps`` timed steps (after ``warmup``) and all losses, for one mode."""
    model = build_model(config, seed=0).to(device)
    source = shards.batches(spec.batch_size, rank, world, spec.seed, 1)

    def moved() -> Iterator[tuple[torch.Tensor, ...]]:
        for x, y in source:
            yield x.to(device), y.to(device)

    if mode == "plain":
        gen = moved()
        batches = [next(gen) for _ in range(warmup + steps)]
        net, opt = _plain_setup(model, spec, device)
        _plain(net, opt, spec, batches[:warmup], device)
        _sync(device)
        start = time.perf_counter()
        losses = _plain(net, opt, spec, batches[warmup:], device)
    else:
        it = moved()
        # DDP, as the plain loop's: "auto" would pick FSDP2 for the 1b size, not equal work
        pm = parallelize(model, 1, device, "ddp")
        opt = make_optimizer(pm.module, spec)
        sched = make_scheduler(opt, spec, 0, warmup + steps)
        run_steps(pm, opt, sched, it, warmup, spec, device)
        _sync(device)
        start = time.perf_counter()
        losses = run_steps(pm, opt, sched, it, steps, spec, device).losses.tolist()
    _sync(device)
    return time.perf_counter() - start, losses


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table (or JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    env = xdist.setup() if "RANK" in os.environ else None
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", env.local_rank if env else 0)
        torch.cuda.set_device(device)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    config = _config(args.size)
    spec = TrainingSpec(batch_size=args.batch, seq_len=args.seq, lr=3e-4, grad_clip=1.0)
    seqs = (args.warmup + args.steps) * args.batch * world * 2
    with tempfile.TemporaryDirectory(prefix="xffl-bench-") as tmp:
        data = ensure_synthetic(Path(tmp) / "data", "alpha", seqs, args.seq)
        shards = TokenShards(data, args.seq)
        if config.vocab_size < shards.vocab_size:
            raise SystemExit("vocabulary too small for the data")
        times: dict[str, list[float]] = {"plain": [], "xffl": []}
        curves: dict[str, list[float]] = {}
        for _ in range(args.trials):
            for mode in ("plain", "xffl"):
                seconds, losses = trial(mode, config, spec, shards, args.warmup, args.steps,
                                        device, rank, world)
                times[mode].append(seconds)
                curves[mode] = losses
    tokens = args.steps * args.batch * args.seq * world
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world, "threads": torch.get_num_threads(),
        "parameters": num_parameters(config), "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "trials": args.trials,
        "plain_tokens_per_s": tokens / statistics.median(times["plain"]),
        "xffl_tokens_per_s": tokens / statistics.median(times["xffl"]),
        "max_loss_difference": max(abs(a - b) for a, b in
                                   zip(curves["plain"], curves["xffl"], strict=True)),
    }
    result["ratio"] = result["xffl_tokens_per_s"] / result["plain_tokens_per_s"]
    if device.type == "cuda":
        with torch.device("meta"):  # the trainer's count: the embedding's lookup is free
            shape = from_config(config)
        per_token = flops_per_token(flop_params(shape), config.num_hidden_layers,
                                    config.num_attention_heads, config.head_dim, args.seq)
        peak = peak_tflops(result["device"])
        for mode in ("plain", "xffl"):
            achieved = per_token * result[f"{mode}_tokens_per_s"] / world
            result[f"{mode}_mfu"] = achieved / (peak * 1e12) if peak else None
    if rank == 0:
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            for key, value in result.items():
                shown = f"{value:,.4g}" if isinstance(value, float) else value
                print(f"{key:>22}: {shown}")
    xdist.teardown()
    return 0 if result["max_loss_difference"] < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
