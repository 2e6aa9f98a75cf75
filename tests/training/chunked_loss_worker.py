"""Per-rank worker for the chunked loss under DDP, FSDP2 and tp 2 (gloo, forked ranks).

Usage: ``python -m xffl.training.forked --nproc-per-node 2 -m
tests.training.chunked_loss_worker OUT TP:MODE:PRESET ...``. For each mesh: the model of
PRESET at tiny-test's widths (seed 1) on a new (dp, tp) mesh; dp rank r takes its rows of a
fixed global batch with targets out of the loss (-100) and packed position ids; the chunked
loss (``loss_chunk`` CHUNK, which does not divide a rank's tokens) scaled as the loop scales it
(dp / the global count of targets in the loss), one backward, the full gradients; xffl's
evaluation with the same chunks; one step of xffl's loop over ACCUM micro-batches. Writes
``OUT/TP-MODE-PRESET/rank<k>.safetensors``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.tensor import DTensor

from tests.training.tp_worker import mesh_config, structure
from xffl.training.chunked_loss import loss_sum
from xffl.training.config import TrainingSpec
from xffl.training.data import IGNORE, TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize

GLOBAL, SEQ, CHUNK, ACCUM = 4, 24, 7, 2
HELD_OUT, EVAL_BATCH = 5, 2
SPEC = TrainingSpec(steps=1, batch_size=GLOBAL, grad_accum=ACCUM, seq_len=SEQ, lr=0.1,
                    adam_eps=1.0, grad_clip=0.5, loss_chunk=CHUNK)


def global_batches(vocab: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """1 + ACCUM global batches: inputs, targets (prompts out of the loss), packed positions."""
    gen = torch.Generator().manual_seed(11)
    pos = torch.cat([torch.arange(10), torch.arange(SEQ - 10)]).expand(GLOBAL, -1).contiguous()
    out = []
    for _ in range(1 + ACCUM):
        x = torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen)
        y = torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen)
        y[:, :4] = IGNORE  # each example's prompt
        y[:, 10:13] = IGNORE
        out.append((x, y, pos))
    return out


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().contiguous()


def run_mesh(tp: int, mode: str, preset: str, out: Path) -> None:
    """One mesh's checks on this rank: OUT/rank<k>.safetensors."""
    config = mesh_config(preset)
    pm = parallelize(build_model(config, seed=1), tp, torch.device("cpu"), mode)
    r, dp = pm.dp_rank, pm.dp_size
    b = GLOBAL // dp
    data = global_batches(config.vocab_size)
    mine = [tuple(t[r * b:(r + 1) * b] for t in batch) for batch in data]
    held_out = TokenShards(ensure_synthetic(out.parent / "held-out", "gamma", HELD_OUT, SEQ),
                           SEQ)
    evaluation = evaluate_net(pm.net, held_out, HELD_OUT, EVAL_BATCH, torch.device("cpu"),
                              "fp32", r, dp, loss_chunk=CHUNK)
    x, y, pos = mine[0]
    count = int((data[0][1] != IGNORE).sum())
    loss = loss_sum(pm.net, x, y, CHUNK, position_ids=pos) * (dp / count)
    loss.backward()
    record = {"loss": loss.detach().reshape(1),
              "eval": torch.tensor([evaluation.loss, evaluation.tokens], dtype=torch.float64)}
    for name, p in pm.module.named_parameters():
        assert p.grad is not None, name
        record[f"grad.{name}"] = _full(p.grad)
    pm.module.zero_grad(set_to_none=True)
    optimizer = make_optimizer(pm.module, SPEC)
    scheduler = make_scheduler(optimizer, SPEC, offset=0, total=1)
    batches: Iterator[tuple[Tensor, ...]] = iter(mine[1:])
    result = run_steps(pm, optimizer, scheduler, batches, 1, SPEC, torch.device("cpu"),
                       masked=True)
    record["losses"] = result.losses.float()
    out.mkdir(parents=True, exist_ok=True)
    save_file(record, str(out / f"rank{dist.get_rank()}.safetensors"),
              metadata={"dp_rank": str(r), "dp": str(dp), "tp": str(pm.tp_size),
                        **structure(pm)})


def main(out: Path, meshes: list[str]) -> None:
    """Run every ``TP:MODE:PRESET`` mesh in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for mesh in meshes:
        tp, mode, preset = mesh.split(":")
        run_mesh(int(tp), mode, preset, out / f"{tp}-{mode}-{preset}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
