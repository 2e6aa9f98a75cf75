"""How a site's hardware ran its round: the device, FLOPs per token, achieved TFLOP/s and MFU,
steady-state tokens/s per GPU and the ranks' peak memory (the update manifest's hardware
metrics, :data:`xffl.aggregator.metrics.HARDWARE_METRICS`).

The FLOP count is torchtitan's (``get_num_flop_per_token``): per token, ``6 x N`` for the
matmul weights ``N`` (every parameter but the input embedding's, whose lookup costs no
FLOP; a tied LM head counts, its matmul is real work) plus ``12 x L x H x Q x T`` for the
attention scores and their weighted sum (L layers, H query heads of size Q, sequence T;
forward 4, backward 8, causality not discounted). A frozen weight (LoRA's base) costs its
forward and its input gradient, ``4 x N_frozen``, and no weight gradient. It is a model
FLOP count: activation checkpointing's recomputation is not counted, norms, rotary,
softmax and the loss (element-wise, no matmul) are left out, and a mixture of experts is
counted as if every expert ran on every token (an over-count).

MFU is the achieved TFLOP/s per device over the device's dense bf16 peak, whatever the
job's precision: an fp32 round is measured against the bf16 tensor cores it leaves unused,
so its MFU is low by design. ``XFFL_PEAK_TFLOPS`` (a site profile's ``env``) declares the
peak of a device the table does not know, or of a CPU; without it a CPU reports no MFU.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from xffl.aggregator import metrics as metric
from xffl.training.arch import ModelConfig
from xffl.training.progress import Speed

PEAK_ENV = "XFFL_PEAK_TFLOPS"  # a device's dense peak TFLOP/s, declared by the site
GIB = float(1 << 30)
MAX_WARMUP_STEPS = 10

# dense (no sparsity) bf16 peak TFLOP/s per device, from the vendors' data sheets; a
# device's name (torch.cuda.get_device_name) is matched, lower-cased, against each
# substring in order: the first that it contains gives its peak, so the specific come first
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("gh200", 989.0),  # "NVIDIA GH200 480GB": the H100 SXM's tensor cores
    ("h200", 989.0),
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.0),
    ("h100", 989.0),  # "NVIDIA H100 80GB HBM3": SXM
    ("h800", 989.0),
    ("a100", 312.0),  # SXM and PCIe, 40 and 80 GB
    ("a800", 312.0),
    ("l40s", 362.0),
    ("l40", 181.0),
    ("mi300x", 1307.4),
    ("mi250x", 191.5),  # per GCD: torch sees each of the two dies as one device
    ("mi250", 181.0),  # per GCD
)


def device_name(device: torch.device) -> str:
    """The device's name as the manifest reports it (``cpu`` on a CPU)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


def device_count(device: torch.device, world: int) -> int:
    """GPUs the site's round ran on: its world size on GPUs, 0 on CPUs."""
    return world if device.type == "cuda" else 0


def peak_tflops(name: str, env: dict[str, str] | None = None) -> float | None:
    """The dense bf16 peak TFLOP/s of the device ``name``: ``XFFL_PEAK_TFLOPS`` when the site
    declares one (a positive number), else the table's, else None (no MFU)."""
    declared = (os.environ if env is None else env).get(PEAK_ENV, "")
    try:
        value = float(declared)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    lowered = name.lower()
    return next((peak for part, peak in PEAK_BF16_TFLOPS if part in lowered), None)


@dataclass(frozen=True)
class FlopParams:
    """The parameters a token's matmuls use: those trained (6 FLOPs each per token) and
    those frozen (4: forward and input gradient)."""

    trained: int
    frozen: int


def flop_params(net: nn.Module) -> FlopParams:
    """``net``'s matmul parameters: every parameter but those used only by an
    ``nn.Embedding`` (a lookup); a tied head's weight counts (a Linear uses it too)."""
    params: dict[int, nn.Parameter] = {}
    matmul: dict[int, bool] = {}
    for module in net.modules():
        lookup = isinstance(module, nn.Embedding)
        for p in module.parameters(recurse=False):
            params[id(p)] = p
            matmul[id(p)] = matmul.get(id(p), False) or not lookup
    trained = sum(p.numel() for k, p in params.items() if matmul[k] and p.requires_grad)
    frozen = sum(p.numel() for k, p in params.items() if matmul[k] and not p.requires_grad)
    return FlopParams(trained=trained, frozen=frozen)


def flops_per_token(params: FlopParams, layers: int, heads: int, head_dim: int,
                    seq_len: int) -> float:
    """Training FLOPs per token: ``6 N_trained + 4 N_frozen + 12 L H Q T`` (torchtitan's
    count, the frozen weights' forward and input gradient for LoRA)."""
    return float(6 * params.trained + 4 * params.frozen
                 + 12 * layers * heads * head_dim * seq_len)


def warmup_steps(planned: int) -> int:
    """Steps left out of the steady-state rate: 10 % of the round's, at least 1 and at most
    MAX_WARMUP_STEPS (none in a round of one step)."""
    return 0 if planned < 2 else min(MAX_WARMUP_STEPS, max(1, planned // 10))


@dataclass
class SteadyClock:
    """The steady-state window of a round's steps, timed from sync to sync: the device is
    synchronised when the warm-up's last step ends and when the loop ends, so the window
    measures the device's work, not the host's enqueueing of it.

    ``step`` after every optimizer step; ``window`` at the end gives (tokens, seconds) of
    the steps after the warm-up, or of every step when the round ended inside its warm-up.
    """

    warmup: int
    sync: Callable[[], None]
    clock: Callable[[], float] = time.perf_counter
    began: float = 0.0  # when the steps began (synced)
    steady_began: float | None = None  # when the warm-up ended (synced)
    tokens: int = 0  # every step's
    steady_tokens: int = 0  # the steps' after the warm-up
    _done: int = field(default=0, repr=False)

    def start(self) -> None:
        """Mark the start of the steps (the device synchronised first)."""
        self.sync()
        self.began = self.clock()
        if self.warmup == 0:
            self.steady_began = self.began

    def step(self, tokens: int) -> None:
        """One optimizer step of ``tokens`` tokens (this rank's) ended."""
        self._done += 1
        self.tokens += tokens
        if self._done > self.warmup:
            self.steady_tokens += tokens
        elif self._done == self.warmup:
            self.sync()
            self.steady_began = self.clock()

    def window(self) -> tuple[int, float]:
        """(tokens, seconds) of the steady state: the steps after the warm-up, timed from
        the sync ending the warm-up to a sync now; every step when none came after it."""
        self.sync()
        now = self.clock()
        if self.steady_began is None or self.steady_tokens == 0:
            return self.tokens, now - self.began
        return self.steady_tokens, now - self.steady_began


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def peak_memory_bytes(device: torch.device) -> float:
    """This rank's peak memory: the CUDA caching allocator's peak of allocated bytes on a
    GPU, else the process's peak resident set size."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # Linux: KiB


def round_speed(module: nn.Module, config: ModelConfig, seq_len: int, device: torch.device,
                world: int) -> Speed:
    """What a round's step lines and hardware metrics are computed with: the site's
    ``world`` devices, the model's FLOPs per token at ``seq_len``, the device's peak."""
    return Speed(devices=world, peak_tflops=peak_tflops(device_name(device)),
                 flops_per_token=flops_per_token(
                     flop_params(module), config.num_hidden_layers,
                     config.num_attention_heads, config.head_dim, seq_len))


def per_device_rate(rank_tokens: int, tp_size: int, seconds: float) -> float:
    """One device's tokens/s: a rank's tokens (each rank of a tensor-parallel group reads
    the same ones) over ``seconds`` (the slowest rank's steady window); 0 without one."""
    return rank_tokens / tp_size / seconds if seconds > 0 else 0.0


def hardware_metrics(tokens_per_device_s: float, speed: Speed,
                     peak_bytes: float) -> dict[str, float]:
    """The manifest's hardware metrics of a round: tokens/s per device, achieved TFLOP/s per
    device, MFU (only with a known peak, and only when at most 1: a higher one means the
    declared peak is wrong, and says so on stderr) and peak memory in GiB."""
    peak = speed.peak_tflops
    tflops = speed.flops_per_token * tokens_per_device_s / 1e12
    out = {metric.TOKENS_PER_S_PER_GPU: tokens_per_device_s, metric.TFLOPS: tflops,
           metric.PEAK_MEMORY_GIB: peak_bytes / GIB}
    if peak is not None:
        mfu = tflops / peak
        if mfu <= 1.0:
            out[metric.MFU] = mfu
        else:
            print(f"xffl.training: {tflops:.1f} TFLOP/s per device is more than the peak of "
                  f"{peak:g} TFLOP/s; no MFU reported (is {PEAK_ENV} right?)",
                  file=sys.stderr, flush=True)
    return out
