"""Per-rank worker for the mixed-precision and memory tests: run under the forked launcher.

Usage: ``python -m xffl.training.forked --nproc-per-node 2 -m tests.training.mp_worker OUT
CASE ...``. Each case runs in turn in the same gloo process group, from a fresh tiny-test
model (seed 1), and writes ``OUT/CASE/rank<k>.safetensors`` with what it saw:

- ``prec-MODE-PRECISION`` (MODE ddp, fsdp at dp 2, or tp at tp 2): xffl's evaluation of
  GLOBAL held-out sequences, then STEPS steps of SGD on one fixed batch through xffl's loop;
  the held-out and step losses, the dtypes the first q_proj saw in the first forward of each
  (weight, output), and those of the master weights and gradients after;
- ``ac-EVERY`` (FSDP2 at dp 2, a 4-layer model, activation checkpointing of every EVERY-th
  layer, 0: none; ac-2 loaded by the sharded loader): the step losses, the full weights and
  rank 0's full state-dict names;
- ``accum-MODE`` (ddp or fsdp at dp 2): one step of ACCUM micro-batches with lr 0; the
  reduced gradient, and under FSDP2 what each parameter's gradient was just before every
  micro-batch's forward (how many elements this rank held of it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.data import TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.parallelize import ParallelModel, parallelize
from xffl.training.sharded_load import load_parallel

CPU = torch.device("cpu")
GLOBAL, SEQ, STEPS, ACCUM, LR = 4, 16, 6, 4, 0.3
AC_LAYERS = 4


def batches(vocab: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches of GLOBAL sequences (a fixed seed)."""
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen),
             torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen)) for _ in range(count)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().contiguous()


def _run(pm: ParallelModel, data: list[tuple[torch.Tensor, torch.Tensor]], spec: TrainingSpec,
         lr: float) -> torch.Tensor:
    """Train ``spec.steps`` SGD steps on this dp rank's rows of ``data`` (cycled); losses."""
    r, b = pm.dp_rank, GLOBAL // pm.dp_size
    mine = [(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for x, y in data]
    feed = iter([mine[i % len(mine)] for i in range(spec.steps * spec.grad_accum)])
    optimizer = torch.optim.SGD([p for p in pm.module.parameters() if p.requires_grad], lr=lr)
    scheduler = make_scheduler(optimizer, spec, offset=0, total=spec.steps)
    return run_steps(pm, optimizer, scheduler, feed, spec.steps, spec, CPU).losses.float()


def _dtype_code(dtype: torch.dtype) -> float:
    return 16.0 if dtype == torch.bfloat16 else 32.0 if dtype == torch.float32 else -1.0


def held_out(out: Path) -> TokenShards:
    """GLOBAL held-out sequences of SEQ tokens (synthetic, the same in every process)."""
    return TokenShards(ensure_synthetic(out / "held-out", "gamma", GLOBAL, SEQ), SEQ)


def precision_case(mode: str, precision: str,
                   out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The evaluation of held_out(out), then STEPS SGD steps on one batch at ``precision``:
    the loss of each, and the dtypes seen in the first forward of each."""
    config = build_config(ModelSpec(preset="tiny-test"))
    tp, dp_mode = (2, "fsdp") if mode == "tp" else (1, mode)
    pm = parallelize(build_model(config, seed=1), tp, CPU, dp_mode, precision=precision)
    seen: dict[str, torch.Tensor] = {}
    phase = ["eval_dtypes"]
    q_proj = pm.module.get_submodule("model.layers.0.self_attn.q_proj")

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        weight = module.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        seen.setdefault(phase[0], torch.tensor([_dtype_code(local.dtype),
                                                _dtype_code(output.dtype)]))

    handle = q_proj.register_forward_hook(hook)
    evaluation = evaluate_net(pm.net, held_out(out), GLOBAL, GLOBAL // pm.dp_size, CPU,
                              precision, pm.dp_rank, pm.dp_size)
    seen["eval"] = torch.tensor([evaluation.loss], dtype=torch.float64)
    # the optimizer is made after the evaluation: an FSDP2 root left unsharded by it (no
    # backward reshards it) would hand SGD its gathered copies, and the root would not learn
    phase[0] = "seen_dtypes"
    spec = TrainingSpec(steps=STEPS, batch_size=GLOBAL, seq_len=SEQ, lr=LR, grad_clip=0.0,
                        precision=precision)  # type: ignore[arg-type]
    losses = _run(pm, batches(config.vocab_size, 1), spec, LR)
    handle.remove()
    masters = {p.dtype for p in pm.module.parameters()}
    grads = {p.grad.dtype for p in pm.module.parameters() if p.grad is not None}
    return ({"losses": losses, **seen},
            {"masters": ",".join(sorted(map(str, masters))),
             "grads": ",".join(sorted(map(str, grads)))})


def checkpoint_case(every: int, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """FSDP2 at dp 2 with checkpointing of every ``every``-th of AC_LAYERS layers; at
    ``every`` 2 loaded into its slices from round 0 on disk, as a sliced site loads it."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    spec = ModelSpec(preset="tiny-test", overrides={"num_hidden_layers": AC_LAYERS})
    config = build_config(spec)
    if every == 2:  # round 0 holds build_model's seed-1 values (the same seeded tensors)
        if dist.get_rank() == 0:
            init_global("mp", spec, 1, out / "global0")
        dist.barrier()
        pm = load_parallel(out / "global0", config, 1, CPU, "fsdp", every, precision="fp32")
    else:
        pm = parallelize(build_model(config, seed=1), 1, CPU, "fsdp", precision="fp32",
                         checkpointing=every)
    wrapped = [n for n, m in pm.module.named_modules() if checkpoint.state(m) is not None]
    spec = TrainingSpec(steps=3, batch_size=GLOBAL, seq_len=SEQ, lr=LR, grad_clip=0.0,
                        precision="fp32")
    record = {"losses": _run(pm, batches(config.vocab_size, 3), spec, LR)}
    record.update({f"weight.{n}": _full(p) for n, p in pm.module.state_dict().items()})
    names = sorted(pm.full_state_dict())
    kept = sorted(pm.full_state_dict(keep=lambda name: True))  # gathered by parameter name
    return record, {"wrapped": ";".join(wrapped), "state_names": ";".join(names),
                    "kept_names": ";".join(kept)}


def accum_case(mode: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One step of ACCUM micro-batches (lr 0): the reduced gradient, and under FSDP2 the
    gradient each rank held before every micro-batch's forward."""
    config = build_config(ModelSpec(preset="tiny-test"))
    pm = parallelize(build_model(config, seed=1), 1, CPU, mode, precision="fp32")
    held: dict[str, torch.Tensor] = {}
    calls = [0]

    def before(module: nn.Module, args: Any) -> None:
        numel = []
        for p in pm.module.parameters():
            g = p.grad
            numel.append(-1 if g is None else
                         g.to_local().numel() if isinstance(g, DTensor) else g.numel())
        held[f"held.{calls[0]}"] = torch.tensor(numel, dtype=torch.int64)
        calls[0] += 1

    handle = pm.module.register_forward_pre_hook(before, prepend=True)  # before FSDP2 unshards
    spec = TrainingSpec(steps=1, batch_size=GLOBAL // 2, grad_accum=ACCUM, seq_len=SEQ,
                        lr=1.0, grad_clip=0.0, precision="fp32")
    _run(pm, batches(config.vocab_size, ACCUM), spec, 0.0)
    handle.remove()
    record = {f"grad.{n.replace('_fsdp_wrapped_module.', '')}": _full(p.grad)
              for n, p in pm.module.named_parameters() if p.grad is not None}
    record["numel"] = torch.tensor([p.numel() for p in pm.module.parameters()])
    return {**record, **held}, {}


def main(out: Path, cases: list[str]) -> None:
    """Run every case in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for case in cases:
        kind, *args = case.split("-")
        if kind == "prec":
            record, meta = precision_case(args[0], args[1], out)
        elif kind == "ac":
            record, meta = checkpoint_case(int(args[0]), out / case)
        else:
            record, meta = accum_case(args[0])
        (out / case).mkdir(parents=True, exist_ok=True)
        save_file(record, str(out / case / f"rank{dist.get_rank()}.safetensors"), metadata=meta)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
