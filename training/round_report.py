"""A round's report: every rank's losses and maxima gathered, the held-out evaluation, and the
update manifest's metrics."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from xffl.aggregator import metrics as metric
from xffl.core.errors import RunFailed
from xffl.training import distributed as xdist
from xffl.training.config import TrainJob
from xffl.training.data import TokenShards
from xffl.training.evaluate import Evaluation, eval_count, evaluate_net
from xffl.training.loop import LoopResult
from xffl.training.parallelize import ParallelModel
from xffl.training.progress import Speed
from xffl.training.telemetry import (
    hardware_metrics,
    peak_memory_bytes,
    per_device_rate,
)


def across_ranks(losses: Tensor, maxima: list[float],
                 device: torch.device) -> tuple[Tensor, list[float]]:
    """Every rank's step losses averaged, and the largest of each of ``maxima`` over the ranks
    (the slowest rank's seconds, the largest peak memory: one all-reduce for all of them)."""
    largest = torch.tensor(maxima, dtype=torch.float64)
    if xdist.is_distributed():
        losses, largest = losses.to(device), largest.to(device)
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        losses, largest = losses.cpu() / xdist.world_size(), largest.cpu()
    return losses, [float(v) for v in largest]


def round_metrics(losses: Tensor, seconds: float, tokens_read: int, lr_last: float,
                   startup: float | None, incoming: Evaluation | None,
                   trained: Evaluation | None, eval_seconds: float,
                   hardware: Mapping[str, float] | None = None) -> dict[str, float]:
    """The update manifest's metrics of a round: losses, speed, start-up, the held-out
    losses of the global it started from and of the update (when the site holds data out),
    and how the hardware ran it (:func:`xffl.training.telemetry.hardware_metrics`)."""
    metrics = {
        metric.LOSS: float(losses.mean()),
        metric.LOSS_FIRST: float(losses[0]),
        metric.LOSS_LAST: float(losses[-1]),
        metric.TOKENS_PER_S: tokens_read / seconds if seconds > 0 else 0.0,
        metric.TRAIN_SECONDS: seconds,
        metric.STEPS: float(len(losses)),
        metric.LR_LAST: lr_last,
        **(hardware or {}),
    }
    if startup is not None:
        metrics[metric.STARTUP_SECONDS] = startup
    if incoming is not None and trained is not None:
        metrics.update({metric.VAL_LOSS: incoming.loss, metric.VAL_LOSS_UPDATE: trained.loss,
                        metric.VAL_SAMPLES: float(incoming.sequences),
                        metric.VAL_TOKENS: float(incoming.tokens),
                        metric.EVAL_SECONDS: eval_seconds})
    return metrics


def held_out_evaluation(job: TrainJob, pm: ParallelModel, held_out: TokenShards | None,
              device: torch.device) -> Evaluation | None:
    """The model as it stands, on the site's held-out sequences (None: it holds none out)."""
    if held_out is None:
        return None
    spec = job.training
    return evaluate_net(pm.net, held_out, eval_count(held_out, job.evaluation, spec),
                        job.evaluation.batch(spec), device,
                        spec.precision, pm.dp_rank, pm.dp_size, spec.loss_chunk)


def round_report(job: TrainJob, pm: ParallelModel, device: torch.device, result: LoopResult,
                  speed: Speed, lr_last: float, startup: float | None,
                  incoming: Evaluation | None, trained: Evaluation | None,
                  eval_seconds: float) -> tuple[Tensor, int, dict[str, float]]:
    """Every rank's step losses averaged, the sequences the round read and the update
    manifest's metrics (collective: one all-reduce); RunFailed when no step fitted."""
    spec = job.training
    losses, (seconds, steady_seconds, peak_bytes) = across_ranks(
        result.losses, [result.seconds, result.steady_seconds, peak_memory_bytes(device)],
        device)
    if len(losses) == 0:
        raise RunFailed(f"site {job.site}: no training step fitted before the deadline "
                        "(time_budget or the SLURM time limit minus time_margin).")
    read = len(losses) * spec.batch_size * spec.grad_accum * pm.dp_size  # sequences read
    return losses, read, round_metrics(
        losses, seconds, read * spec.seq_len, lr_last, startup, incoming, trained,
        eval_seconds, hardware_metrics(per_device_rate(result.steady_tokens, pm.tp_size,
                                                       steady_seconds), speed, peak_bytes))
