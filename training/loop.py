"""The optimizer-step loop of one round: LR schedule, accumulation, FedProx, clipping, deadline.

The pieces are small functions so that tests and the throughput benchmark can check each
against a plain-PyTorch reference: :func:`lr_factor` (linear warmup, then constant or cosine
decay over the whole job), ``config.round_steps`` (a budget in steps or tokens),
:func:`prox_snapshot` / the FedProx gradient term ``mu * (w - w_global)`` (the gradient of
``mu/2 * ||w - w_global||^2``, added after the data-parallel gradient reduction, so it costs
no communication), and :func:`run_steps`, which also stops cleanly at a deadline agreed by
all ranks and prints a step line now and then (:mod:`xffl.training.progress`).

The loss of a step is the mean cross-entropy over the step's targets in the loss, on all dp
ranks and micro-batches together: each micro-batch contributes its sum over its targets in
the loss, divided by the step's count of them (with ``masked`` data an all-reduce of one
number counts them; without a mask every target counts), times dp_size, which the data-
parallel gradient mean divides out again. Targets out of the loss (-100) add nothing to the
loss, its gradient or the count, which the loop returns (``loss_tokens``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from xffl.training.chunked_loss import loss_sum, supports
from xffl.training.config import TrainingSpec
from xffl.training.data import IGNORE
from xffl.training.parallelize import ParallelModel, is_fsdp, uses_bf16
from xffl.training.progress import Speed, StepReporter
from xffl.training.telemetry import SteadyClock, device_sync, warmup_steps


def lr_factor(step: int, total: int, spec: TrainingSpec) -> float:
    """Multiplier of ``spec.lr`` at optimizer step ``step`` (0-based) of ``total`` in the job.

    Linear warmup over ``warmup_steps`` (from lr/warmup to lr), then constant, or a cosine
    decay to ``min_lr_ratio * lr`` at the last step of the job.
    """
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return 1.0
    span = max(1, total - spec.warmup_steps - 1)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    floor = spec.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, spec: TrainingSpec, offset: int,
                   total: int) -> LambdaLR:
    """A LambdaLR whose local step 0 is the job's step ``offset`` (rounds continue the curve)."""
    return LambdaLR(optimizer, lambda s: lr_factor(offset + s, total, spec))


def autocast(device: torch.device, precision: str,
             net: torch.nn.Module | None = None) -> AbstractContextManager[object]:
    """bf16 autocast on GPUs under "auto" (or anywhere under "bf16"); fp32 otherwise. None
    around an FSDP2 ``net``: its mixed-precision policy casts the gathered weights instead
    (:func:`~xffl.training.parallelize.parallelize`)."""
    if uses_bf16(precision, device) and not is_fsdp(net):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def prox_snapshot(pm: ParallelModel) -> list[tuple[torch.nn.Parameter, Tensor]]:
    """(parameter, copy of its value now) pairs: the round's global weights for FedProx."""
    return [(p, p.detach().clone()) for p in pm.module.parameters() if p.requires_grad]


@dataclass
class LoopResult:
    """What a round's loop did: per-step losses on this rank, and whether it stopped early."""

    losses: Tensor  # float64, one per optimizer step taken, on CPU
    stopped_early: bool
    seconds: float
    loss_tokens: int = 0  # targets in the loss over the steps taken, all dp ranks together
    # this rank's tokens and seconds after the warm-up steps, timed from sync to sync
    # (xffl.training.telemetry.SteadyClock; every step when none came after the warm-up)
    steady_tokens: int = 0
    steady_seconds: float = 0.0


def _agree_to_stop(want: bool, device: torch.device) -> bool:
    """True on every rank if any rank wants to stop (one tiny all-reduce)."""
    if not dist.is_available() or not dist.is_initialized():
        return want
    flag = torch.tensor([1.0 if want else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _step_targets(micro: list[tuple[Tensor, ...]], masked: bool, pm: ParallelModel,
                  device: torch.device) -> tuple[int, int]:
    """Targets in the loss of one step on all dp ranks, and on those of this rank's local
    group (the same without ``training.local_groups``); collective when ``masked``."""
    local = sum(int((m[1] != IGNORE).sum()) for m in micro)
    if not masked or not dist.is_available() or not dist.is_initialized():
        return local * pm.dp_size, local * (pm.dp_size // pm.groups)
    count = torch.zeros(pm.groups, dtype=torch.float64, device=device)
    count[pm.group] = local
    dist.all_reduce(count, op=dist.ReduceOp.SUM)  # each dp group's count once per tp rank
    return round(float(count.sum().item()) / pm.tp_size), \
        round(float(count[pm.group].item()) / pm.tp_size)


#: called after each optimizer step with (steps done, the losses so far, targets counted)
AfterStep = Callable[[int, Tensor, int], None]


def run_steps(pm: ParallelModel, optimizer: torch.optim.Optimizer, scheduler: LambdaLR,
              batches: Iterator[tuple[Tensor, ...]], steps: int, spec: TrainingSpec,
              device: torch.device, *, deadline: float | None = None,
              check_deadline: bool = False,
              prox: list[tuple[torch.nn.Parameter, Tensor]] | None = None,
              masked: bool = False, speed: Speed | None = None,
              resume: tuple[Tensor, int] | None = None,
              after_step: AfterStep | None = None) -> LoopResult:
    """Run up to ``steps`` optimizer steps of ``grad_accum`` micro-batches each.

    A batch is (inputs, targets) or (inputs, targets, position ids); ``masked`` (the same on
    every rank) when targets may be -100 (out of the loss).

    With ``check_deadline`` (the same on every rank), the ranks agree before each step
    whether it still fits before ``deadline`` (a time.time() value, known on any rank;
    the last step's duration is the estimate) and stop together if not. ``speed``: what
    the step lines' per-device tokens/s and MFU are computed with. ``resume``: (the losses
    of the steps a checkpoint already took, their targets in the loss): the loop continues
    at the next step (``batches`` and the optimizer continue there too). ``after_step``:
    called after every step (a round's checkpoints).
    """
    losses = torch.zeros(steps, dtype=torch.float64, device=device)
    first = 0 if resume is None else len(resume[0])
    if resume is not None:
        losses[:first] = resume[0].to(device)
    pm.net.train()
    start = time.perf_counter()
    last = 0.0
    done = first
    tokens = 0  # this rank's, so far
    loss_tokens = 0 if resume is None else resume[1]
    rank0 = not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
    reporter = StepReporter.from_env(
        steps, rank0, speed or Speed(devices=pm.dp_size * pm.tp_size))
    clock = SteadyClock(warmup_steps(steps), device_sync(device))
    clock.start()
    stopped = False
    chunked = supports(pm.net)  # the LM head chunk by chunk inside forward (not entry points)
    for step in range(first, steps):
        if check_deadline:
            late = deadline is not None and time.time() + last >= deadline
            if _agree_to_stop(late, device):
                stopped = True
                break
        began = time.perf_counter()
        step_tokens = tokens
        optimizer.zero_grad(set_to_none=True)
        micro_batches = [next(batches) for _ in range(spec.grad_accum)]
        counted, in_group = _step_targets(micro_batches, masked, pm, device)
        loss_tokens += counted
        # the gradient's mean runs over the group's dp ranks (all of them without groups)
        scale = (pm.dp_size // pm.groups) / max(in_group, 1)  # no target: the step moves nothing
        for micro, (inputs, targets, *rest) in enumerate(micro_batches):
            tokens += inputs.numel()
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            extra = {"position_ids": rest[0].to(device)} if rest else {}
            last_micro = micro == spec.grad_accum - 1
            with nullcontext() if last_micro else pm.no_sync():  # backward included (FSDP2)
                with autocast(device, spec.precision, pm.net):
                    loss = loss_sum(pm.net, inputs, targets, spec.loss_chunk, chunked,
                                    **extra) * scale
                torch.autograd.backward(loss)
            losses[step] += loss.detach().double()
        if prox is not None:
            with torch.no_grad():
                for param, anchor in prox:
                    if param.grad is not None:
                        param.grad.add_(param.detach() - anchor, alpha=spec.prox_mu)
        if spec.grad_clip > 0:
            pm.clip_grad_norm_(spec.grad_clip)
        optimizer.step()
        scheduler.step()
        done += 1
        clock.step(tokens - step_tokens)
        last = time.perf_counter() - began
        if reporter is not None and reporter.due(done):  # rank 0's loss: one number synced
            reporter.report(done, float(losses[step].item()), tokens * pm.dp_size)
        if after_step is not None:
            after_step(done, losses, loss_tokens)
    steady_tokens, steady_seconds = clock.window()  # synchronises the device
    return LoopResult(losses=losses[:done].cpu(), stopped_early=stopped,
                      seconds=time.perf_counter() - start, loss_tokens=loss_tokens,
                      steady_tokens=steady_tokens, steady_seconds=steady_seconds)
