"""torchtitan's memory recipe on gloo: bf16 under DDP, FSDP2 and tp 2 against fp32, activation
checkpointing on against off, and FSDP2's per-micro-batch reduce-scatter against DDP.

One launch of two forked ranks (tests/training/mp_worker.py) runs every case in turn; the
references are computed here, in one process, from the same seeded model and batches.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from tests.conftest import REPO
from tests.training.mp_worker import ACCUM, GLOBAL, LR, STEPS, batches, held_out
from xffl.aggregator.shards import ADAPTER_FILE
from xffl.core.errors import InvalidInput
from xffl.training import lora
from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import LoraSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.model import build_model, lm_loss, lm_loss_sum
from xffl.training.parallelize import (
    apply_checkpointing,
    data_parallel_mode,
    fsdp_threshold,
    parallelize,
)
from xffl.training.trainer import train_round

U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significant bits, round to nearest)
U_FP32 = 2.0**-24
MODES = ("ddp", "fsdp", "tp")
CASES = [*(f"prec-{m}-{p}" for m in MODES for p in ("fp32", "bf16")),
         "ac-0", "ac-1", "ac-2", "accum-ddp", "accum-fsdp"]


def global0_at(out: Path) -> tuple[Path, object]:
    """A round-0 global checkpoint of the tiny-test preset (seed 0) in ``out``."""
    return out, init_global("run-test", ModelSpec(preset="tiny-test"), 0, out)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], tuple[
        dict[str, torch.Tensor], dict[str, str]]]:
    """``load(case, rank)``: what that rank of the one launch of every case recorded."""
    out = tmp_path_factory.mktemp("mp")
    cmd = [sys.executable, "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
           "tests.training.mp_worker", str(out), *CASES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return lambda case, rank: _load(out / case / f"rank{rank}.safetensors")


class _Sensitivity:
    """sum |v * dL/dv| over what bf16 rounds, for a loss of ``model`` (see _sensitivities)."""

    def __init__(self, model: nn.Module) -> None:
        self.acts: list[torch.Tensor] = []
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) or "Norm" in type(m).__name__:
                m.register_forward_hook(self._keep)
        self.model = model

    def _keep(self, module: nn.Module, args: tuple[object, ...], out: torch.Tensor) -> None:
        for t in (*(a for a in args if isinstance(a, torch.Tensor)), out):
            if t.is_floating_point() and t.requires_grad:
                t.retain_grad()
                self.acts.append(t)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The sensitivity of the mean loss on (x, y); leaves its gradient in the model."""
        self.acts.clear()
        self.model.zero_grad(set_to_none=True)
        lm_loss(self.model(x), y).backward()
        total = sum(float((p.detach() * p.grad).abs().sum()) for p in self.model.parameters()
                    if p.grad is not None)
        return total + sum(float((t.detach() * t.grad).abs().sum()) for t in self.acts
                           if t.grad is not None)


@functools.cache  # the same fp32 run for every mode: computed once (never modified)
def _sensitivities() -> torch.Tensor:
    """A[s, r]: at fp32 step s of the SGD run the worker makes, sum |v * dL_r/dv| over the
    values v that bf16 rounds (weights; inputs and outputs of every linear, embedding and
    norm), where L_r is dp rank r's half-batch loss (the first-order worst case of its
    change when each v moves by a relative u)."""
    config = build_config(ModelSpec(preset="tiny-test"))
    model = build_model(config, seed=1)
    sensitivity = _Sensitivity(model)
    x, y = batches(config.vocab_size, 1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = torch.zeros(STEPS, 2, dtype=torch.float64)
    half = GLOBAL // 2
    for s in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(2):
            out[s, r] = sensitivity(x[r * half:(r + 1) * half], y[r * half:(r + 1) * half])
            params = list(model.parameters())
            for g, p in zip(grads, params, strict=True):
                g += p.grad / 2 if p.grad is not None else 0
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        opt.step()
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("mixed-precision")
@pytest.mark.parametrize("mode", MODES)
def test_bf16_against_fp32(mode: str, tmp_path: Path, outputs: Callable[..., tuple[
        dict[str, torch.Tensor], dict[str, str]]]) -> None:
    """bf16 (DDP: autocast; FSDP2 and tp 2 under FSDP2: its bf16 policy, no autocast) runs
    the same STEPS SGD steps as fp32 within bf16's rounding, and really computes in bf16.

    Bound (u = 2^-8). To first order, rounding each value v the loss depends on by a
    relative |e| <= u moves a loss L by at most u * A, A = sum |v dL/dv| over the rounded
    values (the worst case: every error of the sign that adds up), computed here on the fp32
    run for each rank's loss and step (_sensitivities: weights and the inputs and outputs of
    every linear, embedding and norm; 6.6 at step 0, 15 at step 5). The roundings it does
    not visit (rotary q/k, attention scores and probabilities, residual sums) number no more
    than those it does in each layer and have like sensitivities, so each step's own
    rounding moves its loss by <= 2 u A[t]. Earlier steps' roundings moved the weights the
    same on every rank; at this learning rate the fp32 losses fall every step (SGD is not
    amplifying a weight perturbation here), so their effect on a later loss is taken as at
    most what they did to their own step: B[t] = 2 u (A[t, r] + sum_{s<t} max_r A[s, r]),
    0.052 at step 0 to 0.47 at step 5. Measured differences: <= 3.1e-3. A run that does not
    learn misses the fp32 losses' fall (0.28 by step 1, 1.0 by step 5) by more: bf16 steps
    that lost their gradients differ by 0.28 at step 1 (bound 0.107). That it
    is bf16 at all: the first q_proj sees bf16 weights (FSDP2's policy) or fp32 weights and a
    bf16 output (autocast), the master weights and gradients are fp32, and the losses are not
    the fp32 ones bit for bit. xffl's evaluation follows the same rule (autocast only without
    FSDP2): its held-out loss, before any step, within step 0's bound on its own sequences.
    """
    sens = _sensitivities()
    # the held-out loss before training: the same step-0 bound on its own sequences
    x, y = held_out(tmp_path).batch(np.arange(GLOBAL))
    config = build_config(ModelSpec(preset="tiny-test"))
    eval_bound = 2 * U_BF16 * _Sensitivity(build_model(config, seed=1))(x, y)
    for rank in (0, 1):
        fp32, meta32 = outputs(f"prec-{mode}-fp32", rank)
        bf16, meta16 = outputs(f"prec-{mode}-bf16", rank)
        for meta in (meta32, meta16):
            assert (meta["masters"], meta["grads"]) == ("torch.float32", "torch.float32"), meta
        # FSDP2 (tp 2 runs under FSDP2 too) gathers bf16 weights; DDP keeps fp32 under autocast
        bf16_seen = [32.0, 16.0] if mode == "ddp" else [16.0, 16.0]
        for phase in ("eval_dtypes", "seen_dtypes"):  # evaluation, then training
            assert fp32[phase].tolist() == [32.0, 32.0]
            assert bf16[phase].tolist() == bf16_seen, phase
        assert abs(float(bf16["eval"][0] - fp32["eval"][0])) <= eval_bound
        own = sens[:, rank] if mode != "tp" else sens.mean(dim=1)  # tp: dp 1, the whole batch
        earlier = torch.cat([torch.zeros(1, dtype=torch.float64),
                             sens.max(dim=1).values.cumsum(0)[:-1]])
        bound = 2 * U_BF16 * (own + earlier)
        diff = (bf16["losses"].double() - fp32["losses"].double()).abs()
        assert bool((diff <= bound).all()), (diff.tolist(), bound.tolist())
        assert float(diff.max()) > 0  # computed in bf16, not fp32 under another name
        assert float(fp32["losses"][0] - fp32["losses"][-1]) > 0.8  # it learns


@pytest.mark.slow
@pytest.mark.xdist_group("mixed-precision")
def test_activation_checkpointing_gives_the_same_training(outputs: Callable[..., tuple[
        dict[str, torch.Tensor], dict[str, str]]]) -> None:
    """FSDP2 at dp 2, 4 layers: checkpointing every layer (true) or every 2nd (k=2, loaded
    into its slices by the sharded loader, as a sliced site loads it) trains
    to the same losses and weights as none, bit for bit (the recompute runs the same fp32
    kernels on the same inputs, so it is deterministic on the CPU), wraps the layers it says,
    and leaves the state-dict names Hugging Face's, gathered by state dict or by parameter."""
    for rank in (0, 1):
        off, meta_off = outputs("ac-0", rank)
        assert meta_off["wrapped"] == ""
        for every, layers in ((1, [0, 1, 2, 3]), (2, [1, 3])):
            on, meta = outputs(f"ac-{every}", rank)
            assert meta["wrapped"] == ";".join(f"model.layers.{i}" for i in layers)
            assert set(on) == set(off)
            for key in off:
                assert torch.equal(on[key], off[key]), (every, key)
            assert meta["state_names"] == meta_off["state_names"]
            if rank == 0:  # by parameter name too (what a LoRA update gathers)
                assert meta["kept_names"] == meta_off["state_names"]
    names = outputs("ac-0", 0)[1]["state_names"].split(";")
    config = build_config(ModelSpec(preset="tiny-test", overrides={"num_hidden_layers": 4}))
    assert names == sorted(build_model(config).state_dict())


def _micro_terms() -> dict[str, torch.Tensor]:
    """sum over ranks and micro-batches of |each one's gradient term| (as the loop scales it:
    the dp mean of sums over targets, divided by the step's 256 targets)."""
    config = build_config(ModelSpec(preset="tiny-test"))
    model = build_model(config, seed=1)
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    half = GLOBAL // 2
    for x, y in batches(config.vocab_size, ACCUM):
        for r in range(2):
            model.zero_grad(set_to_none=True)
            loss = lm_loss_sum(model(x[r * half:(r + 1) * half]), y[r * half:(r + 1) * half])
            (loss / (ACCUM * GLOBAL * x.shape[1])).backward()
            for n, p in model.named_parameters():
                assert p.grad is not None
                total[n] += p.grad.abs()
    return total


@pytest.mark.slow
@pytest.mark.xdist_group("mixed-precision")
def test_fsdp_reduces_every_micro_batch(outputs: Callable[..., tuple[
        dict[str, torch.Tensor], dict[str, str]]]) -> None:
    """FSDP2 at dp 2, grad_accum 4: DDP's gradient, and only a 1/dp shard of each gradient
    is held between micro-batches (no unsharded gradient until the last one).

    Bound: each element of the step's gradient sums the same 8 terms (2 ranks x 4
    micro-batches; the per-term forward and backward are the same fp32 kernels on the same
    gathered weights): DDP adds a rank's 4 micro-batches, then the 2 ranks; FSDP2 adds the 2
    ranks per micro-batch, then the 4 micro-batches. Any order of 8 terms is within
    7 u S of the exact sum (S = sum |terms|, u = 2^-24), so the two within 14 u S (the
    dp mean's /2 and the loss scale 1/128 are exact powers of 2). Measured: 1.9e-9 against
    max |g| 0.025; reducing in bf16 would be off by ~u_bf16 |g| ~ 1e-4.
    """
    terms = _micro_terms()
    for rank in (0, 1):
        ddp, _ = outputs("accum-ddp", rank)
        fsdp, _ = outputs("accum-fsdp", rank)
        for name, s in terms.items():
            key = f"grad.{name}"
            bound = 14 * U_FP32 * s
            assert bool(((ddp[key] - fsdp[key]).abs() <= bound).all()), key
        numel = fsdp["numel"]
        assert fsdp["held.0"].tolist() == [-1] * len(numel)  # zero_grad(set_to_none)
        for micro in range(1, ACCUM):  # after the previous micro-batch's backward
            assert fsdp[f"held.{micro}"].tolist() == (numel // 2).tolist(), micro


def test_auto_picks_fsdp_for_large_models() -> None:
    """auto: FSDP2 from 1 B parameters, or from fewer where 16 B a parameter exceed half of
    the GPU (40 GB: 1 B still; 16 GiB: 0.54 B); DDP below; FSDP2 whenever tp > 1."""
    gib = 1 << 30
    assert fsdp_threshold(None) == 1_000_000_000
    assert fsdp_threshold(80 * gib) == 1_000_000_000
    assert fsdp_threshold(16 * gib) == 16 * gib // 32
    assert data_parallel_mode("auto", 1, 8_030_000_000) == "fsdp"  # Llama 3.1 8B
    assert data_parallel_mode("auto", 1, 999_999_999) == "ddp"
    assert data_parallel_mode("auto", 1, 600_000_000, 16 * gib) == "fsdp"
    assert data_parallel_mode("auto", 1, 500_000_000, 16 * gib) == "ddp"
    assert data_parallel_mode("auto", 2, 1000) == "fsdp"
    assert data_parallel_mode("ddp", 1, 8_030_000_000) == "ddp"  # asked for: as asked
    with pytest.raises(InvalidInput, match="use data_parallel: fsdp"):
        data_parallel_mode("ddp", 2, 1000)


def test_checkpointing_every_kth_layer_keeps_the_names() -> None:
    """One process: every 2nd of 4 layers checkpointed, parameter and state-dict names
    unchanged (saved, and loaded back into a checkpointed model), the same gradient."""
    config = build_config(ModelSpec(preset="tiny-test", overrides={"num_hidden_layers": 4}))
    plain, wrapped = build_model(config, seed=1), build_model(config, seed=1)
    assert apply_checkpointing(wrapped, 2) == 2
    assert apply_checkpointing(build_model(config), 0) == 0
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    wrapped.load_state_dict(plain.state_dict())
    x, y = batches(config.vocab_size, 1)[0]
    for model in (plain, wrapped):
        lm_loss(model(x), y).backward()
    grads = dict(wrapped.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name  # type: ignore[arg-type]


def test_compile_wraps_each_decoder_layer() -> None:
    """training.compile: each decoder layer compiled in place (names kept), nothing else."""
    model = build_model(build_config(ModelSpec(preset="tiny-test")), seed=1)
    names = list(model.state_dict())
    pm = parallelize(model, 1, torch.device("cpu"), precision="fp32", compile=True)
    layers = pm.module.get_submodule("model.layers")
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert pm.module._compiled_call_impl is None
    assert list(pm.module.state_dict()) == names


def test_activation_checkpointing_values() -> None:
    """false, true and k >= 1 are taken (every k-th layer; 1 is every layer); 0 is not."""
    assert TrainingSpec().checkpoint_every == 0
    assert TrainingSpec(activation_checkpointing=True).checkpoint_every == 1
    assert TrainingSpec(activation_checkpointing=3).checkpoint_every == 3
    with pytest.raises(ValueError, match="write false"):
        TrainingSpec(activation_checkpointing=0)


def test_lora_round_with_checkpointing(tmp_path: Path,
                                       make_job: Callable[..., TrainJob]) -> None:
    """A LoRA round (dropout on: the recompute must draw the same masks) with activation
    checkpointing of every layer writes the adapter of the round without it, bit for bit,
    under peft's names (the layers are checkpointed before peft wraps the model)."""
    base, _ = global0_at(tmp_path / "base")
    spec = LoraSpec(r=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "down_proj"])
    adapter0 = tmp_path / "adapter0"
    lora.init_adapter_global("run-test", ModelSpec(preset="tiny-test"), spec, 0, adapter0,
                             "base")
    job = make_job(tmp_path / "data", steps=2, lr=1e-2)
    assert job.data.synthetic is not None
    ensure_synthetic(Path(job.data.path), job.data.synthetic, 64, job.training.seq_len)
    adapters = []
    for every in (False, True):
        training = job.training.model_copy(update={"lora": spec,
                                                   "activation_checkpointing": every})
        out = tmp_path / f"update-{every}"
        train_round(job.model_copy(update={"training": training}), 1, adapter0,
                    Path(job.data.path), out, base_dir=base)
        adapters.append(load_file(str(out / ADAPTER_FILE)))
    off, on = adapters
    assert on.keys() == off.keys() == load_file(str(adapter0 / ADAPTER_FILE)).keys()
    assert all(torch.equal(on[k], off[k]) for k in off)
