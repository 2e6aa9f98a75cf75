"""(dp, tp) meshes on gloo: tensor parallel and data parallel against the unsplit model."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from tests.conftest import REPO
from tests.training.tp_worker import (
    GLOBAL,
    HELD_OUT,
    SEQ,
    STEPS,
    global_batches,
    mesh_config,
)
from tests.workflows.warm_ranks import rank_python
from xffl.core.errors import InvalidInput
from xffl.training.arch import PRESETS, build_config
from xffl.training.config import ModelSpec
from xffl.training.data import TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.model import build_model, lm_loss
from xffl.training.parallelize import (
    check_tensor_parallel,
    data_parallel_mode,
    layer_plan,
    parallelize,
)

# one launch per world size, running its meshes in turn (tests/training/tp_worker.py), through
# the forked launcher xffl runs CPU ranks with (xffl.training.forked: torchrun's engine, the
# ranks forked from one interpreter): one torch start-up per world size, not per rank and mesh
# every family with a tensor-parallel plan, at tp 2 and under FSDP2 at dp 2
FAMILIES = ("tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2")
# "+sharded": loaded into its slices from a round-0 checkpoint, as a sliced site loads it
# (tied embeddings and biases: Qwen2; the 2-D mesh: dp 2 x tp 2)
SHARDED = ((2, "auto", 2, "tiny-qwen2+sharded"), (1, "fsdp", 2, "tiny-qwen2+sharded"),
           (2, "fsdp", 4, "tiny-test+sharded"))
MESHES = [(2, "auto", 2, "tiny-test"), (1, "ddp", 2, "tiny-test"), (1, "fsdp", 2, "tiny-test"),
          (2, "fsdp", 4, "tiny-test"),
          *((tp, mode, 2, f) for f in FAMILIES for tp, mode in ((2, "auto"), (1, "fsdp"))),
          *SHARDED]
LAUNCHES = {n: tuple(f"{tp}:{mode}:{p}" for tp, mode, k, p in MESHES if k == n) for n in (2, 4)}


def test_the_familys_plan_in_torch_styles() -> None:
    """transformers' base_model_tp_plan, per decoder layer, as torch's parallel styles."""
    plan = layer_plan(PRESETS["tiny"].tp_plan or {})
    colwise = {k for k, v in plan.items() if isinstance(v, ColwiseParallel)}
    rowwise = {k for k, v in plan.items() if isinstance(v, RowwiseParallel)}
    assert colwise == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "mlp.gate_proj", "mlp.up_proj"}
    assert rowwise == {"self_attn.o_proj", "mlp.down_proj"}
    qwen3 = layer_plan(PRESETS["tiny-qwen3"].tp_plan or {})
    norm = qwen3["self_attn.q_norm"]  # per-head norm after q_proj: replicated, grads reduced
    assert isinstance(norm, SequenceParallel) and norm.sequence_sharding[0].dim == 2


def test_tensor_parallel_degree_must_divide() -> None:
    config = build_config(ModelSpec(preset="tiny-test"))  # 4 heads, 2 kv heads, mlp 64
    check_tensor_parallel(config, 2, 4)
    with pytest.raises(InvalidInput, match="does not divide the site's 3 ranks"):
        check_tensor_parallel(config, 2, 3)
    with pytest.raises(InvalidInput, match="num_key_value_heads"):
        check_tensor_parallel(config, 4, 4)
    with pytest.raises(InvalidInput, match="needs 2 or more ranks"):
        parallelize(build_model(config), 2, torch.device("cpu"))


def test_data_parallel_mode() -> None:
    assert data_parallel_mode("auto", 1) == "ddp"
    assert data_parallel_mode("auto", 2) == "fsdp"
    assert data_parallel_mode("fsdp", 1) == "fsdp"
    with pytest.raises(InvalidInput, match="use data_parallel: fsdp"):
        data_parallel_mode("ddp", 2)


def _reference(tmp: Path, preset: str = "tiny-test") -> dict[str, Any]:
    """The unsplit model in one process: logits, gradients, 3 AdamW steps (written out here).

    AdamW's first steps are about lr * g / (|g| + eps): at a small eps a gradient element
    near zero whose sign flips with rounding moves by up to 2 lr, so the steps use eps = 1
    (>> |g| <= 0.1), where a step moves by <= 2 lr / eps per unit of gradient change.
    """
    config = mesh_config(preset)
    model = build_model(config, seed=1)
    data = global_batches(config.vocab_size)
    out: dict[str, Any] = {}
    held_out = TokenShards(ensure_synthetic(tmp / "held-out", "gamma", HELD_OUT, SEQ), SEQ)
    out["eval"] = evaluate_net(model, held_out, HELD_OUT, 1, torch.device("cpu"), "fp32").loss
    logits = model(data[0][0])
    lm_loss(logits, data[0][1]).backward()
    out["logits"] = logits.detach()
    for name, p in model.named_parameters():
        assert p.grad is not None
        out[f"grad.{name}"] = p.grad.clone()
    model.zero_grad(set_to_none=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=0.1, betas=(0.9, 0.95), eps=1.0)
    # warmup 1 step, then cosine to 0.1 x lr at the last of 3 steps: factors 1, 1, 0.1
    for (x, y), factor in zip(data[1:], (1.0, 1.0, 0.1), strict=True):
        for group in opt.param_groups:
            group["lr"] = 0.1 * factor
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    for name, p in model.named_parameters():
        out[f"weight.{name}"] = p.detach().clone()
    return out


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118


@pytest.fixture(scope="module")
def mesh_outputs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``launch(nproc)``: the folder of the launch of LAUNCHES[nproc], run on first use."""
    done: dict[int, Path] = {}

    def launch(nproc: int) -> Path:
        if nproc not in done:
            out = tmp_path_factory.mktemp(f"meshes-{nproc}")
            cmd = [str(rank_python()), "-m", "xffl.training.forked", "--nproc-per-node",
                   str(nproc), "-m", "tests.training.tp_worker", str(out), *LAUNCHES[nproc]]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                  check=False, cwd=REPO)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[nproc] = out
        return done[nproc]

    return launch


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """``reference(preset)``: :func:`_reference` of the preset, computed once for the module
    (every mesh of a family compares with the same unsplit run; 6 presets, 17 meshes)."""
    done: dict[str, dict[str, Any]] = {}

    def reference(preset: str) -> dict[str, Any]:
        if preset not in done:
            done[preset] = _reference(tmp_path_factory.mktemp(f"reference-{preset}"), preset)
        return done[preset]

    return reference


@pytest.mark.slow
@pytest.mark.xdist_group("meshes")  # one worker runs each torchrun once
@pytest.mark.parametrize(
    ("tp", "mode", "nproc", "preset"), MESHES,
    ids=[f"dp{n // tp}-tp{tp}-{mode}-{p}" for tp, mode, n, p in MESHES],
)
def test_mesh_matches_the_unsplit_model(tp: int, mode: str, nproc: int, preset: str,
                                        mesh_outputs: Callable[[int], Path],
                                        references: Callable[[str], dict[str, Any]]) -> None:
    """Logits, first gradients and weights after 3 steps of a mesh == the unsplit model's.

    Tolerances (u = 2^-24, fp32). tp splits the row-parallel projections' sums and dp the
    token sums, and GEMMs may be blocked differently for other shapes: every fp32 dot
    product may be summed in another order. Logits (S_z = sum|h W| <= 0.74) pass through
    ~600 summed terms (2 layers of length-8..64 projections, attention, norms; first
    order, layer gains ~ 1): they differ by <= 2 * 600 u S_z = 5.3e-5: 2e-4. A gradient
    element sums N = 64 tokens' terms (S = sum|term| / N <= 0.12 here) and ~1200 terms
    along its forward and backward path: <= 2 (64 + 1200) u S = 1.8e-5: atol 5e-5. Steps:
    the clip factor c = 0.5 / |g| (~0.46, |g| ~ 1.1) differs by eps_c <= 8.7e-4 (|g| sums
    squares of <= 8192 elements: 8192 u / 2 per run, plus |dg|_2 / |g|); with eps = 1 a
    step moves by <= 2 lr / eps per unit of gradient change, so step t differs by
    <= 2 lr_t (c dg + eps_c max|c g|) + 2^-23 (rounding |w| <= 1; max|g| <= 0.094), over
    lr_t = 0.1, 0.1, 0.01: <= 1.6e-5: atol 4e-5. A missing reduction (a rank's half batch)
    changes the gradients by up to 6e-2 and the weights by 4e-3; a missing tp all-reduce
    drops half of each attention and MLP output. Every family runs at tiny-test's widths
    (tp_worker.mesh_config), so the same counts hold: its extra terms are a handful (Qwen3's
    q/k norms sum 8 squares per head, Gemma 2's extra norms and soft-capping one each).
    """
    out = mesh_outputs(nproc) / f"{tp}-{mode}-{preset}"
    ref = references(preset.removesuffix("+sharded"))
    ranks = [_load(out / f"rank{k}.safetensors") for k in range(nproc)]
    dp = nproc // tp
    for got, meta in ranks:
        assert (int(meta["dp"]), int(meta["tp"]), meta["mode"]) == (dp, tp, mode)
        # what ran, not what was asked for: FSDP2 means the root and every decoder layer
        # are FSDPModules and every parameter a DTensor sharded on dim 0 over dp
        if data_parallel_mode(mode, tp) == "fsdp":  # auto at tp > 1 too
            assert int(meta["fsdp_modules"]) == 1 + 2, meta
            assert meta["dtensor_params"] == meta["params"], meta
            assert all("Shard(dim=0)" in p for p in meta["placements"].split(";")), meta
        else:
            assert int(meta["fsdp_modules"]) == 0, meta
            if tp == 1:
                assert int(meta["dtensor_params"]) == 0, meta
        r = int(meta["dp_rank"])
        b = GLOBAL // dp
        rows = slice(r * b, (r + 1) * b)
        # logits of this dp rank's rows: the unsplit model's, within 2e-4 (docstring)
        assert (got["logits"] - ref["logits"][rows]).abs().max() <= 2e-4
        assert got["logits"].shape == (b, SEQ, 256)
        # the held-out loss every rank agrees on: a mean cross-entropy moves by at most twice
        # the largest logit difference (log-softmax is 1-Lipschitz in each logit, the target
        # logit enters once more), so the logits' 2e-4 bounds it by 4e-4; counting a rank's
        # padding sequence, or one rank's share only, moves it by > 1e-2
        assert abs(float(got["eval"][0]) - ref["eval"]) <= 4e-4
        assert int(got["eval"][1]) == HELD_OUT * SEQ
        for key in (k for k in ref if k.startswith("grad.")):
            # dp > 1: each rank's first-backward gradient is its own half-batch gradient
            # until reduced; the reduced one equals the full-batch reference.
            torch.testing.assert_close(got[key], ref[key], atol=5e-5, rtol=0, msg=key)
        for key in (k for k in ref if k.startswith("weight.")):
            torch.testing.assert_close(got[key], ref[key], atol=4e-5, rtol=0, msg=key)
        assert got["losses"].shape == (STEPS,)
    # every rank ends with the same full weights, bit for bit
    first = ranks[0][0]
    for got, _ in ranks[1:]:
        for key in (k for k in first if k.startswith("weight.")):
            assert torch.equal(got[key], first[key]), key
    # rank 0's checkpoint state is the full model under Hugging Face names
    state = {k[len("state."):]: v for k, v in first.items() if k.startswith("state.")}
    assert set(state) == {k[len("weight."):] for k in ref if k.startswith("weight.")}
    for name, value in state.items():
        assert torch.equal(value, first[f"weight.{name}"]), name


