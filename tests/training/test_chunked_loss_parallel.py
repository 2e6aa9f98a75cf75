"""The chunked loss under DDP, FSDP2 (dp 2) and tensor parallelism (tp 2) on gloo: the
losses and gradients of one process computing from its full logits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO
from tests.training.chunked_loss_worker import (
    EVAL_BATCH,
    HELD_OUT,
    SEQ,
    SPEC,
    global_batches,
)
from tests.training.tp_worker import mesh_config
from tests.workflows.warm_ranks import rank_python
from xffl.training.chunked_loss import full_logits_loss
from xffl.training.data import IGNORE, TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import ParallelModel

# untied and tied heads under DDP and FSDP2 at dp 2; tp 2 (FSDP2 over dp 1), head replicated
MESHES = ("1:ddp:tiny-test", "1:ddp:tiny-qwen2", "1:fsdp:tiny-test", "1:fsdp:tiny-qwen2",
          "2:auto:tiny-test")


def _reference(tmp: Path, preset: str) -> dict[str, torch.Tensor]:
    """One process, the full logits in fp32 (loss_chunk 0): loss, gradients, eval, a step."""
    config = mesh_config(preset)
    model = build_model(config, seed=1)
    data = global_batches(config.vocab_size)
    x, y, pos = data[0]
    loss = full_logits_loss(model(x, position_ids=pos), y) / int((y != IGNORE).sum())
    loss.backward()
    out = {"loss": loss.detach()}
    out.update({f"grad.{k}": p.grad.clone() for k, p in model.named_parameters()
                if p.grad is not None})
    model.zero_grad(set_to_none=True)
    held_out = TokenShards(ensure_synthetic(tmp / "held-out", "gamma", HELD_OUT, SEQ), SEQ)
    out["eval"] = torch.tensor(evaluate_net(model, held_out, HELD_OUT, EVAL_BATCH,
                                            torch.device("cpu"), "fp32", loss_chunk=0).loss)
    spec = SPEC.model_copy(update={"loss_chunk": 0})
    pm = ParallelModel(module=model, net=model)
    optimizer = make_optimizer(model, spec)
    result = run_steps(pm, optimizer, make_scheduler(optimizer, spec, 0, 1), iter(data[1:]),
                       1, spec, torch.device("cpu"), masked=True)
    out["step_loss"] = result.losses[0].float()
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All meshes, in one launch of 2 forked ranks."""
    out = tmp_path_factory.mktemp("chunked")
    cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node", "2", "-m",
           "tests.training.chunked_loss_worker", str(out), *MESHES]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("chunked-loss-parallel")  # one worker launches the ranks once
@pytest.mark.parametrize("mesh", MESHES)
def test_parallel_chunked_loss_matches_one_process(mesh: str, launched: Path,
                                                   tmp_path: Path) -> None:
    """Every rank's reduced gradients, the dp-mean loss, the evaluation and a loop step's loss
    (2 micro-batches: no_sync then the reduction) equal one process's full-logits fp32 ones.

    Bounds (u = 2^-24), at tiny-test's widths as in test_parallelize: the dp split, tp's
    row-parallel sums and the chunks (7 tokens, a rank's 48 leave a tail) only reorder fp32
    sums. Logits (S_z = sum|h W| <= 0.74, ~600 summed terms on their path) differ by <= 2 x
    600 u S_z = 5.3e-5, so a mean cross-entropy (1-Lipschitz in each logit, the target logit
    once more) by <= 4 x 5.3e-5 < 4e-4. A gradient element sums <= 96 tokens' terms
    (S <= 0.12) and ~1200 terms along its path: <= 2 (96 + 1200) u S = 1.9e-5: atol 5e-5.
    A rank's missing reduction halves a gradient (differences up to 6e-2); a head missing
    from DDP's or FSDP2's view leaves its gradient unreduced or None.
    """
    tp, mode, preset = mesh.split(":")
    ref = _reference(tmp_path, preset)
    paths = sorted((launched / f"{tp}-{mode}-{preset}").glob("rank*.safetensors"))
    assert len(paths) == 2
    losses, steps = [], []
    for path in paths:
        with safe_open(str(path), "pt") as fh:
            got = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
            meta = fh.metadata()
        assert int(meta["fsdp_modules"]) == (0 if mode == "ddp" else 3), meta
        assert int(meta["tp"]) == int(tp)
        for key in (k for k in ref if k.startswith("grad.")):
            torch.testing.assert_close(got[key], ref[key], atol=5e-5, rtol=0,
                                       msg=lambda m, key=key: f"{key}: {m}")
        assert set(k for k in got if k.startswith("grad.")) == \
            set(k for k in ref if k.startswith("grad."))
        assert abs(float(got["eval"][0]) - float(ref["eval"])) <= 4e-4
        losses.append(float(got["loss"][0]))
        steps.append(float(got["losses"][0]))
    # each rank's loss is its tokens' sum x dp / the global count (at tp 2, dp 1: all of
    # them on both ranks): the mean over the 2 ranks is the global mean
    assert abs(sum(losses) / 2 - float(ref["loss"])) <= 4e-4, (losses, ref["loss"])
    assert abs(sum(steps) / 2 - float(ref["step_loss"])) <= 4e-4, (steps, ref["step_loss"])
