"""The round loop: schedule, accumulation, FedProx, budgets and deadlines, in one process."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.core.errors import RunFailed
from xffl.training import loop
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, TrainingSpec, TrainJob, round_steps
from xffl.training.data import ensure_synthetic
from xffl.training.loop import lr_factor, make_scheduler, prox_snapshot, run_steps
from xffl.training.model import LlamaForCausalLM, build_model, lm_loss
from xffl.training.parallelize import ParallelModel
from xffl.training.trainer import make_optimizer, train_round

CPU = torch.device("cpu")


def _model() -> LlamaForCausalLM:
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
    # cosine from 1 at step 4 down to 0.1 at step 23, through the midpoint 0.55
    for s in range(4, total):
        progress = (s - 4) / (total - 4 - 1)
        assert got[s] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert got[4] == 1.0 and got[-1] == pytest.approx(0.1)
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
    assert seen == pytest.approx([lr_factor(s, 15, spec) for s in range(15)])


def test_round_steps_from_a_token_budget() -> None:
    assert round_steps(TrainingSpec(steps=7), 4) == 7
    spec = TrainingSpec(tokens=10_000, batch_size=4, grad_accum=2, seq_len=64)
    assert round_steps(spec, 2) == math.ceil(10_000 / (4 * 2 * 64 * 2)) == 10


def _train(spec: TrainingSpec, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
           steps: int, **kw: object) -> tuple[LlamaForCausalLM, loop.LoopResult]:
    model = _model()
    pm = ParallelModel(module=model, net=model)
    opt = make_optimizer(model, spec)
    sched = make_scheduler(opt, spec, 0, steps)
    prox = prox_snapshot(pm) if spec.prox_mu > 0 else None
    result = run_steps(pm, opt, sched, batches, steps, spec, CPU, prox=prox, **kw)  # type: ignore[arg-type]
    return model, result


def test_gradient_accumulation_equals_the_big_batch() -> None:
    big = _batches(8, 3)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    one, r1 = _train(TrainingSpec(batch_size=8, lr=1e-3, adam_eps=1e-6), iter(big), 3)
    two, r2 = _train(TrainingSpec(batch_size=4, grad_accum=2, lr=1e-3, adam_eps=1e-6),
                     iter(halves), 3)
    torch.testing.assert_close(r1.losses, r2.losses, atol=1e-6, rtol=0)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_fedprox_matches_the_proximal_loss() -> None:
    """mu * (w - w_global) added to the gradient == autograd of loss + mu/2 ||w - w_global||^2."""
    mu = 0.5
    spec = TrainingSpec(batch_size=4, lr=1e-3, adam_eps=1e-6, prox_mu=mu, grad_clip=0)
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
    plain, _ = _train(TrainingSpec(batch_size=4, lr=1e-3, adam_eps=1e-6, grad_clip=0),
                      iter(data), 4)
    moved = 0.0
    for (name, a), b, c in zip(model.named_parameters(), ref.parameters(),
                               plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, float((a - c).detach().abs().max()))
    assert moved > 1e-5  # the proximal term did change the result


def test_deadline_stops_between_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr(loop.time, "time", lambda: float(next(clock)))
    _, result = _train(TrainingSpec(batch_size=2), iter(_batches(2, 10)), 10,
                       deadline=3.5, check_deadline=True)
    assert result.stopped_early and len(result.losses) == 4  # checks at t=0,1,2,3 pass; 4 stops


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
    # round 2 of 2 continues the job's cosine from step 1e6: lr after its steps is that factor
    assert manifest.metrics["lr_last"] == pytest.approx(
        3e-3 * lr_factor(1_000_000 + steps, 2_000_000, job.training))
    assert load_file(tmp_path / "update" / "model.safetensors").keys()


def test_no_step_before_the_slurm_limit_fails_cleanly(
        tmp_path: Path, global0: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    data = ensure_synthetic(tmp_path / "data", "alpha", 32, 16)
    job = TrainJob(run_id="run-test", site="site-a", model=ModelSpec(preset="tiny-test"),
                   training=TrainingSpec(steps=5, batch_size=2, seq_len=16, time_margin=120),
                   data={"path": str(data)})  # type: ignore[arg-type]
    # the job's time limit ends in 60 s: less than the 120 s margin kept for saving
    monkeypatch.setattr("xffl.training.distributed.slurm_end_time",
                        lambda environ=None: time.time() + 60)
    with pytest.raises(RunFailed, match="no training step fitted before the deadline"):
        train_round(job, 1, global0[0], data, tmp_path / "update")
    assert not (tmp_path / "update").exists()
