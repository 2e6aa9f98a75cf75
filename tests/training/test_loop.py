"""The round loop: schedule, accumulation, FedProx, budgets and deadlines, in one process."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.core.errors import RunFailed
from xffl.training import loop
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, TrainingSpec, TrainJob, round_steps
from xffl.training.data import ensure_synthetic
from xffl.training.loop import lr_factor, make_scheduler, prox_snapshot, run_steps
from xffl.training.model import build_model, lm_loss
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import ParallelModel
from xffl.training.trainer import train_round

CPU = torch.device("cpu")


def _model() -> nn.Module:
    return build_model(build_config(ModelSpec(preset="tiny-test")), seed=1)


def _batches(size: int, count: int, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (size, 16), generator=gen),
             torch.randint(0, 256, (size, 16), generator=gen)) for _ in range(count)]


def test_lr_factor_warmup_then_cosine() -> None:
    spec = TrainingSpec(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    total = 24
    got = [lr_factor(s, total, spec) for s in range(total)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    # cosine from 1 at step 4 down to 0.1 at step 23, through the midpoint 0.55.
    # Tolerance: each side makes <= 6 float64 roundings (u = 2^-53; cos within 1 ulp, sin'
    # <= 1) of terms <= pi, so it is within 6 pi u = 2.1e-15 of the exact value: the two
    # differ by <= 4.2e-15, i.e. 4.2e-14 of a value >= 0.1: rel 1e-13. A wrong schedule
    # (off by one step, a missing floor) is off by > 1e-3.
    for s in range(4, total):
        progress = (s - 4) / (total - 4 - 1)
        assert got[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)),
                                       rel=1e-13, abs=0)
    assert got[4] == 1.0 and got[-1] == pytest.approx(0.1, rel=1e-13, abs=0)
    assert lr_factor(3, 10, TrainingSpec()) == 1.0  # constant, no warmup


def test_scheduler_continues_across_rounds() -> None:
    """Round r's scheduler starts where round r-1's ended: one curve over the job."""
    spec = TrainingSpec(lr=1.0, schedule="cosine", warmup_steps=2, steps=5)
    seen: list[float] = []
    for rnd in (1, 2, 3):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=spec.lr)
        sched = make_scheduler(opt, spec, offset=(rnd - 1) * 5, total=15)
        for _ in range(5):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    # LambdaLR sets lr = base lr (1.0) * lr_factor(step): a product by 1.0 is exact, so the
    # values must be equal bit for bit (a scheduler restarting each round is off by > 0.1)
    assert seen == [lr_factor(s, 15, spec) for s in range(15)]


def test_round_steps_from_a_token_budget() -> None:
    assert round_steps(TrainingSpec(steps=7), 4) == 7
    spec = TrainingSpec(tokens=10_000, batch_size=4, grad_accum=2, seq_len=64)
    assert round_steps(spec, 2) == math.ceil(10_000 / (4 * 2 * 64 * 2)) == 10


def _train(spec: TrainingSpec, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
           steps: int, **kw: object) -> tuple[nn.Module, loop.LoopResult]:
    model = _model()
    pm = ParallelModel(module=model, net=model)
    opt = make_optimizer(model, spec)
    sched = make_scheduler(opt, spec, 0, steps)
    prox = prox_snapshot(pm) if spec.prox_mu > 0 else None
    result = run_steps(pm, opt, sched, batches, steps, spec, CPU, prox=prox, **kw)  # type: ignore[arg-type]
    return model, result


def test_gradient_accumulation_equals_the_big_batch() -> None:
    """2 micro-batches of 4 accumulated == 1 batch of 8, over 3 AdamW steps.

    Tolerance (u = 2^-24, fp32). The two runs order the fp32 sums differently: each
    gradient element sums N = 128 per-token terms (S = sum|term| / N <= 0.09 here) and its
    forward and backward path runs through dot products of C ~ 1200 terms in all (2 layers
    of length-32/64 projections, attention, norms; first order, layer gains ~ 1), so the
    gradients differ by <= 2 (N + C) u S = 1.4e-5. With adam_eps = 1 >> |g| (<= 0.06) an
    AdamW step moves by <= 2 lr / eps per unit of gradient change (at eps = 1e-6 a sign
    flip of a gradient near 0 moves a weight by 2 lr), and the gradient norm (< 0.8) stays
    under grad_clip = 1, so the clip factor is exactly 1. 3 steps at lr 0.1, plus one
    rounding of |w| <= 1 (2^-23) per step: weights differ by <= 3 (0.2 * 1.4e-5 + 1.2e-7)
    = 9e-6: atol 2e-5. Losses (per-token <= 5.91; logits' sums S_z <= 0.74): logits
    differ by <= 2 * 600 u S_z = 5.3e-5 (600: the forward path), cross-entropy is
    2-Lipschitz in them, the two means of 128 terms differ by <= 2 * 127 u * 5.91, and
    the weight gap (2-norm <= 0.2 * 2 (N + C) u |S|_2 (2.4) per step) moves a loss by
    <= |grad| (0.78) times it: <= 3.1e-4 in all: atol 1e-3. A real accumulation bug (a
    micro-batch used twice or dropped, gradients zeroed between the micro-batches, a
    missing / grad_accum) moves the weights by >= 7e-3 (and the losses by ~1e-2, or x2).
    """
    big = _batches(8, 3)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    one, r1 = _train(TrainingSpec(batch_size=8, lr=0.1, adam_eps=1.0), iter(big), 3)
    two, r2 = _train(TrainingSpec(batch_size=4, grad_accum=2, lr=0.1, adam_eps=1.0),
                     iter(halves), 3)
    torch.testing.assert_close(r1.losses, r2.losses, atol=1e-3, rtol=0)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0, msg=name)


def test_fedprox_matches_the_proximal_loss() -> None:
    """mu * (w - w_global) added to the gradient == autograd of loss + mu/2 ||w - w_global||^2.

    Tolerance. Both runs compute the data gradient with the same kernels on the same
    shapes, and the proximal gradient exactly (0.5 * (w - a): a power-of-two multiple of the
    same fp32 difference), so their gradients can differ at most by the rounding of the
    final sum, 1 ulp (2^-24 |g + mu (w - a)| < 1e-8). With adam_eps = 1 an AdamW step
    moves by <= 2 lr / eps = 0.2 per unit of gradient change (at eps = 1e-6 a 1-ulp change
    of a gradient near 0 can flip its step: 2 lr), and each step rounds |w| <= 1 to 2^-23:
    4 steps differ by <= 4 (0.2 * 1e-8 + 1.2e-7) = 5e-7: atol 1e-6. Dropping the
    proximal term or doubling mu moves the weights by ~8e-4 (``moved`` below).
    """
    mu = 0.5
    spec = TrainingSpec(batch_size=4, lr=0.1, adam_eps=1.0, prox_mu=mu, grad_clip=0)
    data = _batches(4, 4)
    model, _ = _train(spec, iter(data), 4)

    ref = _model()
    anchor = [p.detach().clone() for p in ref.parameters()]
    opt = make_optimizer(ref, spec)
    for x, y in data:
        opt.zero_grad()
        prox = sum(((p - a) ** 2).sum() for p, a in zip(ref.parameters(), anchor, strict=True))
        (lm_loss(ref(x), y) + mu / 2 * prox).backward()
        opt.step()
    plain, _ = _train(TrainingSpec(batch_size=4, lr=0.1, adam_eps=1.0, grad_clip=0),
                      iter(data), 4)
    moved = 0.0
    for (name, a), b, c in zip(model.named_parameters(), ref.parameters(),
                               plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((a - c).detach().abs().max()))
    assert moved > 1e-4  # the proximal term did change the result, by 100x the tolerance


def test_deadline_stops_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(loop.time, "time", lambda: float(next(clock)))
    _, result = _train(TrainingSpec(batch_size=2), iter(_batches(2, 10)), 10,
                       deadline=3.5, check_deadline=True)
    assert result.stopped_early and len(result.losses) == 4  # checks at t=0,1,2,3 pass; 4 stops


def _stop_rank(rank: int, where: str) -> None:
    """One of two gloo ranks training under one deadline check: rank 0's own deadline passes
    before its 5th step (the fake clock above), rank 1 has none of its own."""
    store = torch.distributed.FileStore(f"{where}/store", 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        if rank == 0:
            clock = iter(range(100))
            loop.time.time = lambda: float(next(clock))  # this fork's only: it ends below
        _, result = _train(TrainingSpec(batch_size=2), iter(_batches(2, 10)), 10,
                           deadline=3.5 if rank == 0 else None, check_deadline=True)
        Path(where, f"{rank}.txt").write_text(repr((result.stopped_early, len(result.losses))))
    finally:
        torch.distributed.destroy_process_group()


def test_the_ranks_stop_together_when_one_is_late(tmp_path: Path) -> None:
    """Two gloo ranks: rank 0 is late before its 5th step, rank 1 never is on its own; they
    agree before each step (one all-reduce) and both stop after 4 steps. A rank that went on
    alone would meet its peers' next collective without them (DDP's all-reduce hangs)."""
    torch.multiprocessing.start_processes(_stop_rank, args=(str(tmp_path),), nprocs=2,
                                          start_method="fork")
    assert [(tmp_path / f"{r}.txt").read_text() for r in range(2)] == ["(True, 4)"] * 2


def test_time_budget_writes_a_checkpoint(tmp_path: Path, global0: tuple[Path, Manifest],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    data = ensure_synthetic(tmp_path / "data", "alpha", 32, 16)
    job = TrainJob(run_id="run-test", site="site-a", rounds=2, model=ModelSpec(preset="tiny-test"),
                   training=TrainingSpec(steps=1_000_000, batch_size=2, seq_len=16,
                                         time_budget=1.0, schedule="cosine"),
                   data={"path": str(data)})  # type: ignore[arg-type]
    manifest = train_round(job, 2, global0[0], data, tmp_path / "update")
    assert verify_checkpoint(tmp_path / "update") == manifest
    steps = manifest.extra["steps"]
    assert manifest.extra["stopped_early"] is True and 1 <= steps < 1_000_000
    assert manifest.num_tokens == steps * 2 * 16 == manifest.metrics["steps"] * 32
    # round 2 of 2 continues the job's cosine from step 1e6: lr after its steps is that factor.
    # LambdaLR computes base lr * factor, the same float64 product as here: bitwise equal
    # (a schedule restarted at step 0 gives ~3e-3 instead of ~1.6e-3).
    assert manifest.metrics["lr_last"] == \
        3e-3 * lr_factor(1_000_000 + steps, 2_000_000, job.training)
    assert load_file(tmp_path / "update" / "model.safetensors").keys()


def test_no_step_before_the_slurm_limit_fails_cleanly(
        tmp_path: Path, global0: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    data = ensure_synthetic(tmp_path / "data", "alpha", 32, 16)
    job = TrainJob(run_id="run-test", site="site-a", model=ModelSpec(preset="tiny-test"),
                   training=TrainingSpec(steps=5, batch_size=2, seq_len=16, time_margin=120),
                   data={"path": str(data)})  # type: ignore[arg-type]
    # the job's time limit ends in 60 s: less than the 120 s margin kept for saving
    monkeypatch.setattr("xffl.training.distributed.job_end_time",
                        lambda environ=None: time.time() + 60)
    with pytest.raises(RunFailed, match="no training step fitted before the deadline"):
        train_round(job, 1, global0[0], data, tmp_path / "update")
    assert not (tmp_path / "update").exists()


def test_the_deadline_leaves_the_updates_evaluation_before_the_slurm_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a SLURM limit, training stops time_margin plus the evaluation's seconds before
    it (the update is evaluated after training, as long as the incoming global took);
    time_budget counts training alone, from after the first evaluation."""
    from xffl.training.trainer import round_deadline

    end = time.time() + 3600
    monkeypatch.setattr("xffl.training.distributed.job_end_time", lambda environ=None: end)
    spec = TrainingSpec(time_margin=120)
    assert round_deadline(spec, reserve=7.5) == end - 120 - 7.5
    monkeypatch.setattr("xffl.training.distributed.job_end_time", lambda environ=None: None)
    before = time.time()
    budget = round_deadline(TrainingSpec(time_budget=10), reserve=7.5)
    assert budget is not None and before + 10 <= budget <= time.time() + 10
