"""Per-rank worker for the (dp, tp) exactness tests: run under torchrun, writes what it saw.

Usage: ``torchrun --nproc-per-node N tp_worker.py OUT TP:MODE[:PRESET] ...``. For each
mesh in turn, in the same process group: builds the model of PRESET (tiny-test by default;
another family's tiny preset at tiny-test's widths: :func:`mesh_config`) with seed 1,
parallelizes it with tensor_parallel TP and data parallel MODE over a new mesh of all N
ranks, then on a fixed global batch of GLOBAL sequences (dp rank r takes its GLOBAL/dp
consecutive rows) records the logits, the gradients of the first backward (gathered to
full tensors), the validation loss of HELD_OUT held-out sequences (xffl's evaluation, with
an uneven last batch) and, after 3 optimizer steps of xffl's own loop, the full weights:
``OUT/TP-MODE-PRESET/rank<k>.safetensors`` per rank, with what the ranks really ran under
(FSDP2 modules, sharded parameters) in its metadata. Several meshes in one launch save a torch
start-up per rank and mesh; each mesh starts from a fresh model, optimizer and groups.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tests.training.warm import warm_presets
from xffl.training.arch import ModelConfig, build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.data import TokenShards, ensure_synthetic
from xffl.training.evaluate import evaluate_net
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model, lm_loss
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import ParallelModel, parallelize
from xffl.training.sharded_load import load_parallel

GLOBAL, SEQ, STEPS = 4, 16, 3
HELD_OUT, EVAL_BATCH = 5, 2  # with dp 2, the last global batch leaves dp rank 1 nothing
# adam_eps 1 (>> |g| <= 0.1): AdamW's step is Lipschitz in the gradient (<= 2 lr / eps), so
# fp32 rounding cannot flip a step's sign as at eps 1e-6 (see test_parallelize._reference)
SPEC = TrainingSpec(steps=STEPS, batch_size=GLOBAL, seq_len=SEQ, lr=0.1, adam_eps=1.0,
                    grad_clip=0.5, weight_decay=0.1, schedule="cosine", warmup_steps=1)


def global_batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS + 1 global batches of GLOBAL sequences (the first for logits and gradients)."""
    gen = torch.Generator().manual_seed(7)
    return [(torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen),
             torch.randint(0, vocab, (GLOBAL, SEQ), generator=gen)) for _ in range(STEPS + 1)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().contiguous()


def mesh_spec(preset: str) -> ModelSpec:
    """PRESET's family at tiny-test's widths (hidden 32, 4 heads of 8 over 2 kv heads, MLP
    64, 2 layers), so that one derivation of the tolerances holds for every family."""
    overrides: dict[str, int | float | bool] = {}
    if preset != "tiny-test":
        overrides = {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8,
                     "max_position_embeddings": 128}
    return ModelSpec(preset=preset, overrides=overrides)


def mesh_config(preset: str) -> ModelConfig:
    """The config of :func:`mesh_spec`."""
    return build_config(mesh_spec(preset))


def structure(pm: ParallelModel) -> dict[str, str]:
    """What ran: FSDP2 modules (root and layers) and how the parameters are placed."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [n for n, m in pm.module.named_modules() if isinstance(m, FSDPModule)]
    placements = sorted({str(p.placements) for p in pm.module.parameters()
                         if isinstance(p, DTensor)})
    return {"fsdp_modules": str(len(fsdp)), "placements": ";".join(placements),
            "dtensor_params": str(sum(isinstance(p, DTensor) for p in pm.module.parameters())),
            "params": str(sum(1 for _ in pm.module.parameters()))}


def _sharded(preset: str, tp: int, mode: str, out: Path) -> ParallelModel:
    """The model as a site loads it into its slices: round 0 written by the coordinator's
    code (seed 1, the values build_model gives), then loaded tensor by tensor."""
    spec = mesh_spec(preset)
    if dist.get_rank() == 0:
        init_global("mesh", spec, 1, out / "global0")
    dist.barrier()
    return load_parallel(out / "global0", build_config(spec), tp, torch.device("cpu"), mode)


def run_mesh(tp: int, mode: str, preset: str, out: Path) -> None:
    """Run the checks of one (TP, MODE) mesh on this rank and write OUT/rank<k>.safetensors.

    A PRESET ending in ``+sharded`` loads the model as a sliced site does (``_sharded``)."""
    base, sharded = preset.removesuffix("+sharded"), preset.endswith("+sharded")
    config = mesh_config(base)
    pm = (_sharded(base, tp, mode, out) if sharded else
          parallelize(build_model(config, seed=1), tp, torch.device("cpu"), mode))
    ran = structure(pm)
    r, dp = pm.dp_rank, pm.dp_size
    b = GLOBAL // dp
    data = global_batches(config.vocab_size)
    mine = [(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for x, y in data]

    held_out = TokenShards(ensure_synthetic(out.parent / "held-out", "gamma", HELD_OUT, SEQ),
                           SEQ)
    evaluation = evaluate_net(pm.net, held_out, HELD_OUT, EVAL_BATCH, torch.device("cpu"),
                              "fp32", r, dp)

    logits = pm.net(mine[0][0])
    lm_loss(logits, mine[0][1]).backward()
    record = {"logits": logits.detach().contiguous(),
              "eval": torch.tensor([evaluation.loss, evaluation.tokens], dtype=torch.float64)}
    for name, p in pm.module.named_parameters():
        assert p.grad is not None, name
        record[f"grad.{name}"] = _full(p.grad)
    pm.module.zero_grad(set_to_none=True)

    optimizer = make_optimizer(pm.module, SPEC)
    scheduler = make_scheduler(optimizer, SPEC, offset=0, total=STEPS)
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(mine[1:])
    result = run_steps(pm, optimizer, scheduler, batches, STEPS, SPEC, torch.device("cpu"))
    record["losses"] = result.losses.float()
    for name, p in pm.module.named_parameters():
        record[f"weight.{name}"] = _full(p)
    state = pm.full_state_dict()
    if dist.get_rank() == 0:
        record.update({f"state.{k}": v.clone() for k, v in state.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(record, str(out / f"rank{dist.get_rank()}.safetensors"),
              metadata={"dp_rank": str(r), "dp": str(dp), "tp": str(pm.tp_size),
                        "mode": mode, **ran})


def warm_imports(argv: list[str]) -> None:
    """The meshes' families' model code, imported once before the ranks fork."""
    warm_presets(["tiny-test", *(m.split(":")[2].removesuffix("+sharded")
                                 for m in argv[1:] if m.count(":") == 2)])


def main(out: Path, meshes: list[str]) -> None:
    """Run every ``TP:MODE`` mesh in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for mesh in meshes:
        tp, mode, *rest = mesh.split(":")
        preset = rest[0] if rest else "tiny-test"
        run_mesh(int(tp), mode, preset, out / f"{tp}-{mode}-{preset}")
    # every rank leaves together: a rank that tears gloo down while rank 0 (which also
    # gathers and writes the full state) is still talking to it aborted rank 0 once, with
    # "terminate called without an active exception", under a fully loaded machine
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
