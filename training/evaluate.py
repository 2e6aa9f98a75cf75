"""Validation at a site: the mean next-token loss of a model on the site's held-out sequences.

The same function serves every layout of the model: a single process, DDP, FSDP2 or a
tensor-parallel mesh. The first ``count`` held-out sequences are read in order, in global
batches of ``batch_size`` sequences per dp rank; each dp rank takes every dp_size-th sequence
of a global batch, and a rank left without one still runs the forward (on a sequence it does
not count), so that every rank runs the same collectives (FSDP2 gathers, tensor-parallel
reductions). The sums of token losses and of tokens are all-reduced in float64; each dp
group's sums arrive once per tensor-parallel rank, in both, so their ratio is the mean.
Only targets in the loss count (instruction and chat data: the responses; a target of
-100 is skipped in the sum and the count), so the loss is their mean and ``tokens`` their
number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from xffl.training.chunked_loss import DEFAULT_CHUNK, loss_sum, supports
from xffl.training.config import EvaluationSpec, TrainingSpec
from xffl.training.data import IGNORE, TokenShards
from xffl.training.loop import autocast
from xffl.training.parallelize import is_fsdp


@dataclass(frozen=True)
class Evaluation:
    """A model's mean token loss on ``sequences`` held-out sequences (``tokens`` targets)."""

    loss: float
    sequences: int
    tokens: int


def eval_count(held_out: TokenShards, evaluation: EvaluationSpec,
               training: TrainingSpec) -> int:
    """How many held-out sequences one evaluation reads: all, or the budget's, if fewer."""
    return min(len(held_out), evaluation.sequences(training))


@torch.no_grad()
def evaluate_net(net: nn.Module, held_out: TokenShards, count: int, batch_size: int,
                 device: torch.device, precision: str = "auto", dp_rank: int = 0,
                 dp_size: int = 1, loss_chunk: int = DEFAULT_CHUNK) -> Evaluation:
    """The mean token loss of ``net`` on the first ``count`` held-out sequences (collective).

    Every rank of the process group calls it with the same arguments but its own dp rank;
    the LM head runs ``loss_chunk`` tokens at a time, as in training.
    """
    was_training = net.training
    net.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    per_batch = batch_size * dp_size
    chunked = supports(net)
    try:
        for start in range(0, count, per_batch):
            mine = np.arange(start, min(start + per_batch, count))[dp_rank::dp_size]
            counted = len(mine) > 0
            rows = mine if counted else np.zeros(1, dtype=np.int64)
            inputs, targets = held_out.batch(rows)
            pos = held_out.positions(rows)
            extra = {} if pos is None else {"position_ids": pos.to(device)}
            inputs, targets = inputs.to(device), targets.to(device)
            with autocast(device, precision, net):
                loss = loss_sum(net, inputs, targets, loss_chunk, chunked, **extra)
            if counted:
                sums += torch.stack([loss.double(), (targets != IGNORE).sum().double()])
    finally:
        net.train(was_training)
        if is_fsdp(net):  # no backward resharded the root: its gathered weights would stay
            net.reshard()  # type: ignore[operator]
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        tp = dist.get_world_size() // dp_size
    else:
        tp = 1
    total, tokens = (float(v) for v in sums.cpu())
    # no target in the loss among them (a held-out part of prompts only): no loss to report
    return Evaluation(loss=total / max(tokens, 1.0), sequences=count, tokens=round(tokens / tp))
