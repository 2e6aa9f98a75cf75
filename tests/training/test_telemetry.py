"""The hardware numbers of a site's round: FLOPs per token, MFU, the steady-state window.

The FLOP count is checked by hand on a small Llama and against torch's own FlopCounterMode
on a real forward and backward of it; MFU against the peak of a named device; the
steady-state window against a simulated device whose work the host only enqueues.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import Manifest
from xffl.training.checkpoint import load_model, read_config
from xffl.training.config import TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.progress import Speed, StepReporter
from xffl.training.round_report import across_ranks
from xffl.training.telemetry import (
    GIB,
    PEAK_ENV,
    FlopParams,
    SteadyClock,
    flop_params,
    flops_per_token,
    hardware_metrics,
    peak_tflops,
    warmup_steps,
)
from xffl.training.trainer import train_round

# a small Llama: d=32, 2 layers, 4 query heads of 8 (2 key/value heads), MLP 48, vocab 96
D, LAYERS, HEADS, KV, FFN, VOCAB, T, B = 32, 2, 4, 2, 48, 96, 16, 2
HEAD = D // HEADS


def _llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV, max_position_embeddings=64,
                         tie_word_embeddings=tie)
    # eager attention: its two matmuls are torch.bmm, which FlopCounterMode counts (the CPU's
    # fused SDPA kernel is not in its table)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


# by hand: per layer q (d x d) + k, v (d x kv*head each) + o (d x d) + gate, up, down
# (3 x d x ffn) + two RMSNorm weights (d each); then the final norm (d) and the head (v x d);
# the input embedding (v x d) is a lookup and costs nothing
PER_LAYER = D * D + 2 * D * KV * HEAD + D * D + 3 * D * FFN + 2 * D  # 7744
NORMS = 2 * LAYERS * D + D  # 160: the RMSNorm weights (element-wise, no matmul)
N = LAYERS * PER_LAYER + D + VOCAB * D  # 18592
FLOPS_PER_TOKEN = 6 * N + 12 * LAYERS * HEADS * HEAD * T  # 111552 + 12288 = 123840


@pytest.mark.parametrize("tie", [False, True])
def test_the_flop_count_of_a_small_llama_by_hand(tie: bool) -> None:
    net = _llama(tie)
    assert flop_params(net) == FlopParams(trained=N, frozen=0)  # tied: the head counts once
    assert flops_per_token(flop_params(net), LAYERS, HEADS, HEAD, T) == FLOPS_PER_TOKEN == 123840
    # LoRA's count: a frozen weight costs 4 per token (forward, input gradient), not 6
    for p in net.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    frozen = 3 * D * FFN
    assert flop_params(net) == FlopParams(trained=N - frozen, frozen=frozen)
    assert flops_per_token(flop_params(net), LAYERS, HEADS, HEAD, T) == \
        FLOPS_PER_TOKEN - 2 * frozen


def test_the_flop_count_against_torchs_flop_counter() -> None:
    """FlopCounterMode counts every matmul (mm, bmm) a forward and backward run: each
    Linear's forward, input gradient and weight gradient (2 + 2 + 2 FLOPs per weight and
    token: the first layer's input gradients too, since the embedding's output requires
    grad) and attention's QK^T and AV with their four backward bmm (12 L H Q T per token).
    The count adds 6 per token for each RMSNorm weight, which is element-wise work the
    counter leaves out, and nothing else: the two agree exactly after those 6 x NORMS."""
    net = _llama()
    inputs = torch.randint(0, VOCAB, (B, T))
    with FlopCounterMode(display=False) as counter:
        logits = net(inputs).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs.flatten()).backward()
    counted = counter.get_total_flops()
    ours = flops_per_token(flop_params(net), LAYERS, HEADS, HEAD, T) * B * T
    assert counted == ours - 6 * NORMS * B * T == 3932160


def test_mfu_is_the_achieved_tflops_over_the_named_devices_peak(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA GH200 480GB") == peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert peak_tflops("AMD Instinct MI250X") == 191.5
    assert peak_tflops("cpu") is None
    # 4000 tokens/s per GPU at 1.2e11 FLOPs per token (about an 8B model): 480 TFLOP/s
    h100 = Speed(4, 1.2e11, peak_tflops("NVIDIA H100 80GB HBM3"))
    out = hardware_metrics(4000.0, h100, 3 * 2**30)
    assert out[metric.TFLOPS] == pytest.approx(480.0, rel=1e-12)
    assert out[metric.MFU] == pytest.approx(480.0 / 989.0, rel=1e-12)  # 0.4853
    assert out[metric.PEAK_MEMORY_GIB] == 3.0
    assert metric.MFU not in hardware_metrics(4000.0, Speed(1, 1.2e11, peak_tflops("cpu")), 0.0)
    monkeypatch.setenv(PEAK_ENV, "2.5")  # a CPU's peak, declared by its site
    cpu = hardware_metrics(1000.0, Speed(1, 1e9, peak_tflops("cpu")), 0.0)
    assert cpu[metric.MFU] == pytest.approx(1.0 / 2.5, rel=1e-12)
    # a peak declared too low would give an MFU above 1: none is reported
    assert metric.MFU not in hardware_metrics(1000.0, Speed(1, 1e10, peak_tflops("cpu")), 0.0)


class _Device:
    """A device the host enqueues work on in 1 ms; ``sync`` waits until it has done it."""

    def __init__(self) -> None:
        self.host = 0.0
        self.busy_until = 0.0
        self.syncs = 0

    def enqueue(self, seconds: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + seconds
        self.host += 0.001

    def sync(self) -> None:
        self.syncs += 1
        self.host = max(self.host, self.busy_until)

    def clock(self) -> float:
        return self.host


def test_the_steady_state_leaves_out_the_warm_up_and_times_the_devices_work() -> None:
    """20 steps of 100 tokens: the 2 warm-up steps take the device 10 s each, the other 18
    take 1 s each; the host only enqueues them (1 ms a step). The steady window is 1800
    tokens in 18 s of device time: 100 tokens/s. With the warm-up it would be 2000 / 38 s
    (52.6/s); read without a sync, the host's 18 ms of enqueueing (100000/s)."""
    assert warmup_steps(20) == 2 and warmup_steps(1) == 0 and warmup_steps(10**7) == 10
    device = _Device()
    clock = SteadyClock(warmup_steps(20), device.sync, device.clock)
    clock.start()
    for step in range(20):
        device.enqueue(10.0 if step < 2 else 1.0)
        clock.step(100)
    tokens, seconds = clock.window()
    assert (tokens, seconds) == (1800, pytest.approx(18.0, abs=1e-9))
    assert tokens / seconds == pytest.approx(100.0, rel=1e-9)
    assert device.syncs == 3  # at the start, when the warm-up ended, at the end: no more


def test_a_round_inside_its_warm_up_is_timed_whole() -> None:
    device = _Device()
    clock = SteadyClock(3, device.sync, device.clock)
    clock.start()
    for _ in range(2):  # the deadline stopped it after 2 steps
        device.enqueue(5.0)
        clock.step(100)
    assert clock.window() == (200, pytest.approx(10.0, abs=1e-9))


def test_a_step_line_carries_one_devices_rate_and_mfu(tmp_path: Path) -> None:
    """The step line's ``tokens/s/gpu`` and ``mfu`` are one device's since the previous
    line: 4 GPUs reading 16000 tokens in 2 s are 2000 tokens/s each; at 1.2e11 FLOPs per
    token that is 240 TFLOP/s, 24.3 % of an H100's 989."""
    speed = Speed(devices=4, flops_per_token=1.2e11, peak_tflops=989.0)
    assert speed.text(16000, 2.0) == " tokens/s/gpu 2000 mfu 24.3%"
    assert Speed(devices=2).text(1000, 1.0) == " tokens/s/gpu 500 mfu -"
    log = tmp_path / "steps.log"
    reporter = StepReporter(10, log, 0.0, speed)
    reporter.report(1, 3.5, 4000)
    first_at = reporter.last
    reporter.report(2, 3.4, 9000)  # 5000 tokens since the first line
    assert first_at is not None and reporter.last is not None
    words = log.read_text().splitlines()[1].split()
    assert words[:5] == ["step", "2/10", "loss", "3.4000", "tokens/s"] and words[6] == "eta"
    per_device = 5000 / 4 / (reporter.last - first_at)
    assert words[8:] == ["tokens/s/gpu", f"{per_device:.0f}", "mfu",
                         f"{100 * 1.2e11 * per_device / 1e12 / 989.0:.1f}%"]


def _rank(rank: int, store_dir: str, peaks: list[float], out: str) -> None:
    store = torch.distributed.FileStore(f"{store_dir}/store", 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        losses, largest = across_ranks(torch.tensor([1.0 + rank, 3.0], dtype=torch.float64),
                                       [10.0 * (rank + 1), peaks[rank]], torch.device("cpu"))
        Path(out, f"{rank}.txt").write_text(repr((losses.tolist(), largest)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("peaks", [[5.0 * GIB, 2.0 * GIB], [1.0 * GIB, 7.5 * GIB]])
def test_peak_memory_and_seconds_are_the_largest_of_any_rank(tmp_path: Path,
                                                             peaks: list[float]) -> None:
    """Two gloo ranks: the losses are averaged, the seconds and the peak memory are each
    rank's largest (one all-reduce), on both ranks, whichever rank holds the peak."""
    torch.multiprocessing.start_processes(_rank, args=(str(tmp_path), peaks, str(tmp_path)),
                                          nprocs=2, start_method="fork")
    for rank in range(2):
        assert (tmp_path / f"{rank}.txt").read_text() == repr(([1.5, 3.0], [20.0, max(peaks)]))


def test_the_lora_flop_count_against_torchs_flop_counter() -> None:
    """LoRA (r 4 on q and v): the frozen base costs 4 per weight and token (forward, input
    gradient), the adapter 6. FlopCounterMode counts that less the norms' 4 x NORMS (no
    matmul) and less what autograd skips in the first layer, whose input (the frozen
    embedding's output) needs no gradient: the input gradients of its q, k and v
    projections (2 per weight) and of its two A factors, and attention's dK (its K does
    not require grad there: 2 H T Q)."""
    from peft import LoraConfig, get_peft_model

    net = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                              lora_dropout=0.0))
    params = flop_params(net)
    r = 4  # per layer: q's A (r x d) and B (d x r), v's A (r x d) and B (kv head x r)
    adapter = LAYERS * ((r * D + D * r) + (r * D + KV * HEAD * r))
    assert params == FlopParams(trained=adapter, frozen=N) == FlopParams(trained=896,
                                                                         frozen=18592)
    inputs = torch.randint(0, VOCAB, (B, T))
    with FlopCounterMode(display=False) as counter:
        logits = net(inputs).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), inputs.flatten()).backward()
    skipped = 2 * (D * D + 2 * D * KV * HEAD) + 2 * (2 * r * D) + 2 * HEADS * T * HEAD  # 5632
    ours = flops_per_token(params, LAYERS, HEADS, HEAD, T)
    assert counter.get_total_flops() == (ours - 4 * NORMS - skipped) * B * T == 2744320


def test_a_cpu_round_reports_its_hardware_and_a_declared_peaks_mfu(
        tmp_path: Path, global0: tuple[Path, Manifest], make_job: Callable[..., TrainJob],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A round on the CPU: device ``cpu``, 0 GPUs, its steady tokens/s and TFLOP/s (the
    model's FLOPs per token times that rate), its peak RSS; no MFU until the site declares
    a peak, then the TFLOP/s over it."""
    g0, _ = global0
    job = make_job(tmp_path / "data", sequences=30, steps=12)
    assert job.data.synthetic is not None
    data = ensure_synthetic(Path(job.data.path), job.data.synthetic, 30, job.training.seq_len)
    config = read_config(g0)
    per_token = flops_per_token(flop_params(load_model(g0)), config.num_hidden_layers,
                                config.num_attention_heads, config.head_dim, 16)
    for peak in (None, "0.5"):
        if peak is None:
            monkeypatch.delenv(PEAK_ENV, raising=False)
        else:
            monkeypatch.setenv(PEAK_ENV, peak)
        manifest = train_round(job, 1, g0, data, tmp_path / f"update-{peak}")
        got = manifest.metrics
        assert (manifest.extra["device"], manifest.extra["gpus"]) == ("cpu", 0)
        rate = got[metric.TOKENS_PER_S_PER_GPU]
        # 12 steps: the first (10 %, at least 1) is warm-up, the steady window has 11 x 32
        # tokens, so its rate is not the round's 12 x 32 tokens over the whole loop
        assert rate > 0 and rate != got[metric.TOKENS_PER_S]
        assert got[metric.TFLOPS] == pytest.approx(per_token * rate / 1e12, rel=1e-12)
        # this process's peak RSS holds at least torch (> 100 MiB), far below 16 GiB
        assert 0.1 < got[metric.PEAK_MEMORY_GIB] < 16
        if peak is None:
            assert metric.MFU not in got
        else:
            assert got[metric.MFU] == pytest.approx(got[metric.TFLOPS] / 0.5, rel=1e-12)
