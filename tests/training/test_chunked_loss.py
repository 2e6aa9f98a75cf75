"""The chunked LM head + cross-entropy: the full-logits loss and gradients, at a fraction of
the memory (measured exactly, tensor by tensor), in training and in evaluation."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.bench.scripts import load_bench
from tests.training.custom_model import TinyMLPLM
from xffl.training.arch import build_config
from xffl.training.chunked_loss import (
    chunked_cross_entropy,
    full_logits_loss,
    loss_sum,
    supports,
)
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.data import TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.model import build_model

U = 2.0 ** -24  # fp32 unit roundoff
TOKENS = (2, 24)  # 48 tokens: chunks of 16 divide them, of 7 leave a tail of 6
CHUNKS = (16, 7, 1, 48, 0)


def gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error of an n-term fp32 sum."""
    return n * U / (1 - n * U)


def _batch(vocab: int, seed: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """Inputs, targets (some -100) and packed position ids (two examples per row)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, TOKENS, generator=gen)
    y = torch.randint(0, vocab, TOKENS, generator=gen)
    y[0, :9] = -100  # a prompt out of the loss, across a chunk border
    y[1, 20:] = -100
    pos = torch.cat([torch.arange(10), torch.arange(TOKENS[1] - 10)]).expand(TOKENS[0], -1)
    return x, y, pos.contiguous()


def head_bounds(h: Tensor, w: Tensor, y: Tensor, softcap: float | None = None) -> dict[str, Any]:
    """First-order fp32 error bounds of one evaluation of the head + summed cross-entropy,
    and of its gradients, from the values themselves (in float64); two evaluations that sum in
    other orders (chunks, GEMM blocking) differ by at most twice each.

    Per logit z = h.w (H terms): e_z = gamma_H |h|.|w|. A token loss lse(z) - z_t moves by at
    most 2 max e_z (lse is 1-Lipschitz in the max-norm), and its own evaluation (V
    exponentials of z - m, their sum, a log, + m) errs by gamma_{V+3} (1 + |lse| + max|z|):
    eps_i. The sum over n tokens adds gamma_n L. dL/dz = p - onehot with p = exp(z - lse):
    |dp| <= p (eps_i + u). grad_h = g W sums V terms, grad_W = g^T h sums n terms (across
    chunks in another order): |d grad| <= |dg| |.| + gamma_k |g| |.|. A soft-cap
    c tanh(z / c) is 1-Lipschitz and errs by 3 u (1 + |z|) more; it scales g by tanh's
    derivative (<= 1).
    """
    h, w = h.double().reshape(-1, h.shape[-1]), w.double()
    labels = y.reshape(-1)
    keep = labels != -100
    z = h @ w.T
    e_z = gamma(h.shape[1]) * (h.abs() @ w.abs().T)
    slope = torch.ones_like(z)
    if softcap is not None:
        e_z = e_z + 3 * U * (1 + z.abs())
        slope = 1 - torch.tanh(z / softcap) ** 2
        z = torch.tanh(z / softcap) * softcap
    lse = torch.logsumexp(z, dim=1)
    vocab = w.shape[0]
    eps = 2 * e_z.max(dim=1).values + gamma(vocab + 3) * (1 + lse.abs() + z.abs().max(dim=1).values)
    losses = lse - z.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    total = float(losses[keep].sum())
    p = torch.softmax(z, dim=1) * keep[:, None]
    g = (p - torch.nn.functional.one_hot(labels.clamp(min=0), vocab) * keep[:, None]) * slope
    dg = p * (eps + U)[:, None]
    n = h.shape[0]
    return {
        "loss": total,
        "loss_bound": 2 * (float(eps[keep].sum()) + gamma(n) * total),
        "grad_h": (g @ w).float(),
        "grad_h_bound": 2 * (dg @ w.abs() + gamma(vocab) * (g.abs() @ w.abs())),
        "grad_w": (g.T @ h).float(),
        "grad_w_bound": 2 * (dg.T @ h.abs() + gamma(n) * (g.abs().T @ h.abs())),
    }


def _head_grads(h0: Tensor, w0: Tensor, y: Tensor, chunk: int | None) -> tuple[Tensor, ...]:
    """Loss, grad wrt hidden states and head weight: chunked, or (None) from full logits."""
    h = h0.clone().requires_grad_(True)
    head = nn.Linear(w0.shape[1], w0.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(w0)
    if chunk is None:
        loss = full_logits_loss(head(h), y)
    else:
        loss = chunked_cross_entropy(h, head, y, chunk)
    loss.backward()
    assert h.grad is not None and head.weight.grad is not None
    return loss.detach(), h.grad, head.weight.grad


def _ratio(diff: Tensor, bound: Tensor) -> float:
    """The largest |difference| / bound, element by element (<= 1: within the bound)."""
    diff = diff.double().abs().reshape(bound.shape)
    return float(torch.where(diff == 0, 0.0, diff / bound).max())  # no bound: equal


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunks_equal_the_full_logits(chunk: int) -> None:
    """Loss and its gradients wrt the hidden states and the head: the full-logits fp32 ones,
    within twice the first-order fp32 bound of each (:func:`head_bounds`), for chunks that
    divide the 48 tokens, leave a tail, are single tokens or all of them. Dropping the tail
    chunk, or a chunk's targets shifted by one, moves the loss by ~5 per token."""
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(*TOKENS, 32, generator=gen)
    w0 = torch.randn(256, 32, generator=gen) * 0.2
    _, y, _ = _batch(256)
    bounds = head_bounds(h0, w0, y)
    ref = _head_grads(h0, w0, y, None)
    got = _head_grads(h0, w0, y, chunk)
    assert abs(float(got[0]) - float(ref[0])) <= bounds["loss_bound"], (got[0], ref[0])
    assert abs(float(got[0]) - bounds["loss"]) <= bounds["loss_bound"]
    assert _ratio(got[1] - ref[1], bounds["grad_h_bound"]) <= 1
    assert _ratio(got[2] - ref[2], bounds["grad_w_bound"]) <= 1
    masked = (y == -100)
    assert (got[1][masked] == 0).all()  # a target out of the loss moves nothing


MODELS = {"untied": "tiny-test", "tied": "tiny-qwen2", "tied-softcap": "tiny-gemma2",
          "tied-llama": "tiny-test+tied"}  # Llama-3.2-1B's tied embedding


def _model(preset: str, vocab: int = 256) -> nn.Module:
    overrides: dict[str, int | float | bool] = {"vocab_size": vocab}
    if preset.endswith("+tied"):
        preset, overrides["tie_word_embeddings"] = preset.removesuffix("+tied"), True
    if preset != "tiny-test":
        overrides.update(hidden_size=32, intermediate_size=64, head_dim=8)
    if preset == "tiny-gemma2":
        overrides["final_logit_softcapping"] = 1.0  # soft-capping visible at these logits
    return build_model(build_config(ModelSpec(preset=preset, overrides=overrides)), seed=1)


def _model_grads(model: nn.Module, chunk: int | None) -> dict[str, Tensor]:
    """The loss and every parameter's gradient, chunked or (None) from the full logits; the
    gradient wrt the final hidden states too (a hook on the decoder's output)."""
    model.zero_grad(set_to_none=True)
    x, y, pos = _batch(256)
    seen: dict[str, Tensor] = {}

    def keep(module: nn.Module, args: Any, out: Any) -> None:
        out.last_hidden_state.register_hook(lambda g: seen.setdefault("grad_h", g))
        seen["h"] = out.last_hidden_state.detach()

    handle = model.get_decoder().register_forward_hook(keep)  # type: ignore[operator]
    try:
        loss = (full_logits_loss(model(x, position_ids=pos), y) if chunk is None
                else loss_sum(model, x, y, chunk, position_ids=pos))
        loss.backward()
    finally:
        handle.remove()
    out = {"loss": loss.detach(), **seen}
    out.update({f"grad.{k}": p.grad.clone() for k, p in model.named_parameters()
                if p.grad is not None})
    return out


@pytest.mark.parametrize("chunk", (16, 7))
@pytest.mark.parametrize("kind", MODELS)
def test_the_models_chunked_loss_and_gradients(kind: str, chunk: int) -> None:
    """Through the model's forward: the same loss, hidden-state gradient and gradients of every
    parameter (the tied embedding's two uses included) as the family's own full logits.

    The decoder runs the same ops on the same shapes on both sides, so the hidden states are
    equal bit for bit and only the head's part differs: the loss and the hidden-state
    gradient within :func:`head_bounds`. A decoder parameter's gradient is J^T grad_h over the
    same backward: the difference is J^T (d grad_h), of norm <= ||J|| ||d grad_h||; here
    ||J^T x|| / ||x|| is measured on the reference (x = grad_h itself, the direction the
    difference follows to first order) and a factor 4 covers other directions (the two
    layers' gains are ~1). A missing head or tied-embedding gradient, or a soft-cap left out,
    moves the gradients by >= 1e-2 of their norm.
    """
    model = _model(MODELS[kind])
    ref = _model_grads(model, None)
    got = _model_grads(model, chunk)
    assert torch.equal(got["h"], ref["h"])
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    bounds = head_bounds(ref["h"], head.detach(), _batch(256)[1], softcap)
    assert abs(float(got["loss"]) - float(ref["loss"])) <= bounds["loss_bound"]
    assert _ratio(got["grad_h"] - ref["grad_h"], bounds["grad_h_bound"]) <= 1
    assert set(got) == set(ref)
    gain = max(float(ref[k].norm()) for k in ref if k.startswith("grad.")) / \
        float(ref["grad_h"].norm())
    d_h = float((bounds["grad_h_bound"]).norm())
    for key in (k for k in ref if k.startswith("grad.")):
        assert float((got[key] - ref[key]).norm()) / (4 * gain * d_h) <= 1, key


def test_an_entry_point_model_keeps_full_logits() -> None:
    """A user's module returns logits only: its loss comes from them, as before."""
    config = build_config(ModelSpec(preset="tiny-test"))
    model = TinyMLPLM(config)
    assert not supports(model)
    x, y, _ = _batch(256)
    assert torch.equal(loss_sum(model, x, y, 7), full_logits_loss(model(x), y))
    assert supports(_model("tiny-test"))
    assert TrainingSpec().loss_chunk == 1024


# exact peak of live tensor bytes, forward and backward ops alike (the benchmark's counter)
PeakBytes = load_bench("chunked_loss").PeakBytes


MEM_N, MEM_H, MEM_V, MEM_C = 1024, 16, 32768, 128  # full fp32 logits 128 MiB, a chunk 16 MiB


def _head_peak(chunk: int) -> int:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(MEM_N, MEM_H, generator=gen).requires_grad_(True)
    head = nn.Linear(MEM_H, MEM_V, bias=False)
    y = torch.randint(0, MEM_V, (MEM_N,), generator=gen)
    with PeakBytes() as mem:
        chunked_cross_entropy(h, head, y, chunk).backward()
    return mem.peak


@pytest.mark.parametrize("chunk", (MEM_C, 0))
def test_peak_memory_is_a_few_chunks(chunk: int) -> None:
    """Forward + backward at a vocabulary that dominates: the peak of live tensor bytes is
    at most 3 chunks of fp32 logits plus the head's gradient twice, not the full logits.

    In a chunk's backward, alive at once: the recomputed log-softmax (saved), the gradient
    nll_loss hands it (dense), and log-softmax's input gradient: 3 x C x V x 4 B (the forward
    holds 2: logits and log-softmax); then the chunk's V x H weight gradient and the
    accumulated one; the hidden states' gradient (N x H) and a chunk's slice of it; a few
    scalars. With loss_chunk 0 the same bound at C = N holds, 8 x over a chunk's: the test of
    the chunked bound fails (the full logits alone are 128 MiB).
    """
    c = MEM_C  # the bound is the chunked one whatever ran: chunk 0 must fail it
    bound = 3 * c * MEM_V * 4 + 2 * MEM_V * MEM_H * 4 + 3 * MEM_N * MEM_H * 4 + 64 * 1024
    peak = _head_peak(chunk)
    if chunk == 0:
        assert peak > MEM_N * MEM_V * 4 > bound  # what the chunks avoid: shown, not assumed
    else:
        assert peak <= bound < MEM_N * MEM_V * 4 / 2, (peak, bound)


def test_training_and_evaluation_stay_under_the_full_logits(tmp_path: Path) -> None:
    """Through the model (tiny-test at a 32768 vocabulary, 4 x 256 tokens): a training
    micro-batch's forward + backward, and an evaluation batch, peak at 3 chunks of fp32 logits
    (:func:`test_peak_memory_is_a_few_chunks`) plus 4 V x H tensors (the head's gradient
    twice, the embedding's, one spare) plus 2 MiB for the decoder's activations at width 32,
    half the full logits; with loss_chunk 0 above the full fp32 logits."""
    model = _model("tiny-test", MEM_V)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 256), generator=gen)
    y = torch.randint(0, 256, (4, 256), generator=gen)
    full = x.numel() * MEM_V * 4
    held_out = TokenShards(ensure_synthetic(tmp_path / "held", "gamma", 4, 256), 256)
    for chunk in (MEM_C, 0):
        with PeakBytes() as train:
            loss_sum(model, x, y, chunk).backward()
        model.zero_grad(set_to_none=True)
        with PeakBytes() as evaluation:
            evaluate_net(model, held_out, 4, 4, torch.device("cpu"), "fp32", loss_chunk=chunk)
        bound = 3 * MEM_C * MEM_V * 4 + 4 * MEM_V * 32 * 4 + 2 * 2**20
        if chunk:
            assert max(train.peak, evaluation.peak) <= bound < full / 1.9, (train.peak, bound)
        else:
            assert train.peak > full and evaluation.peak > full, (train.peak, full)


@pytest.mark.parametrize("how", ("autocast", "bf16-weights"))
def test_a_bf16_head_gives_an_fp32_loss(how: str) -> None:
    """With bf16 logits (bf16 autocast, as under DDP; or bf16 weights, as under FSDP2's
    mixed precision) each chunk is upcast before the cross-entropy: the loss is fp32 and equals
    the full bf16 logits upcast at once, within what bf16 logits allow. A chunk's GEMM may
    round a logit to the other neighbouring bf16 value (2^-8 |z| apart): a token loss moves by
    <= 2 x 2^-8 max|z|, over n tokens; the fp32 sums add 2 gamma_n L. Without the upcast the
    sum itself is bf16 (one ulp of a loss of ~200 is 1), and its dtype tells."""
    model = _model("tiny-test")
    x, y, pos = _batch(256)
    if how == "bf16-weights":
        model.to(torch.bfloat16)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if how == "autocast" else nullcontext()
    with ctx:
        logits = model(x, position_ids=pos)
        ref = full_logits_loss(logits, y)
        got = loss_sum(model, x, y, 7, position_ids=pos)
    assert logits.dtype == torch.bfloat16 and got.dtype == torch.float32
    n = int((y != -100).sum())
    full, chunked = float(ref.detach()), float(got.detach())
    bound = n * 2 * 2.0 ** -8 * float(logits.detach().float().abs().max()) + 2 * gamma(n) * full
    assert abs(chunked - full) <= bound, (chunked, full, bound)
    got.backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all())
               for p in model.parameters())
