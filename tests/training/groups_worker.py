"""Per-rank worker for the local-groups tests: plain data parallelism and local groups.

Usage: ``python -m xffl.training.forked --nproc-per-node 4 -m tests.training.groups_worker
OUT STEPS LAYOUT ...`` with LAYOUT ``MODE,OPT[,gG,kK[,moments|nesterov|masked]]``: MODE
ddp, fsdp, hsdpS (HSDP with shard_group S) or tp2 (FSDP2 with tensor parallel 2, the
tiny-test model), OPT ``linear`` or ``adamw`` (:data:`OPTIMIZERS`), G groups averaging
every K steps. For each layout in turn, in one gloo process group: :class:`Bigram`
(float64, seed 3) through xffl's :func:`~xffl.training.parallelize.parallelize` with
``groups``, STEPS steps of xffl's loop on fixed global batches (rank r reads the rows of
its site-wide dp rank: the same rows under every layout) with the groups' sync of
:mod:`xffl.training.local_groups` after every step and at the end, then
``OUT/LAYOUT/rank<k>.safetensors``: the step losses, the initial and final full weights,
each parameter's local shard, the mesh and the sync's metrics in its metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn import functional as F

from tests.training.warm import warm_presets
from xffl.training.chunked_loss import _MARK  # the loop's own-loss protocol
from xffl.training.config import TrainingSpec
from xffl.training.group_spec import LocalGroupsSpec
from xffl.training.local_groups import chain, make_sync
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize

VOCAB, HIDDEN, GLOBAL, SEQ = 16, 8, 8, 8
SEED, DATA_SEED = 3, 11
# linear: AdamW with eps = 2^60, which absorbs sqrt(v_hat) <= 1 (< ulp(2^60) / 2 = 128), so
# that its step is exactly lr / bias_correction1 * exp_avg / 2^60: SGD with momentum, linear
# in the gradients (lr = 0.1 * 2^60: a step of 0.1 * m_hat). adamw: AdamW as xffl runs it.
OPTIMIZERS = {"linear": {"lr": 0.1 * 2.0 ** 60, "adam_eps": 2.0 ** 60},
              "adamw": {"lr": 0.05, "adam_eps": 0.01}}


class Bigram(nn.Module):
    """logits = embed(x) @ head.T: the smallest model xffl's loop trains (as a
    ``model.entry_point`` model), small enough for a numpy forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        setattr(self, _MARK, True)  # computes its own loss (xffl.training.chunked_loss)
        gen = torch.Generator().manual_seed(SEED)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen,
                                                dtype=torch.float64))
            self.head.weight.copy_(0.5 * torch.randn(VOCAB, HIDDEN, generator=gen,
                                                     dtype=torch.float64))

    def forward(self, input_ids: Tensor, loss_targets: Tensor,
                loss_chunk: int = 0) -> Tensor:
        """The sum of the token cross-entropies, in float64 (xffl's loop calls a model that
        computes its own loss so; its full-logits path would round the logits to fp32)."""
        logits = self.head(self.embed(input_ids))
        return F.cross_entropy(logits.reshape(-1, VOCAB), loss_targets.reshape(-1),
                               reduction="sum")


def global_batches(steps: int, masked: bool = False) -> list[tuple[Tensor, Tensor]]:
    """Every step's GLOBAL rows of (inputs, targets), the same in every layout; ``masked``:
    the first 5 targets of the first half of the rows are -100 (out of the loss), so that
    the groups count 12 and 32 targets."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    out = [(torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=gen),
            torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=gen)) for _ in range(steps)]
    if masked:
        for _, y in out:
            y[:GLOBAL // 2, :5] = -100
    return out


def parse(layout: str) -> tuple[str, str, LocalGroupsSpec | None]:
    """(mode, optimizer, groups spec) of a LAYOUT argument."""
    mode, opt, *rest = layout.split(",")
    if not rest:
        return mode, opt, None
    extra = rest[2:]
    return mode, opt, LocalGroupsSpec(groups=int(rest[0][1:]), every=int(rest[1][1:]),
                                      average_moments="moments" in extra,
                                      outer="nesterov" if "nesterov" in extra else "average",
                                      outer_lr=0.7, outer_momentum=0.9)


def _full(p: Tensor) -> Tensor:
    full = getattr(p, "full_tensor", None)
    return (full() if callable(full) else p).detach().double().contiguous()


def _model(mode: str) -> nn.Module:
    """Bigram, or for ``tp2`` the tiny-test transformers model (seed 1, float32), whose
    family has a tensor-parallel plan."""
    if mode != "tp2":
        return Bigram()
    from xffl.training.arch import build_config
    from xffl.training.config import ModelSpec
    from xffl.training.model import build_model

    return build_model(build_config(ModelSpec(preset="tiny-test")), seed=1)


def run_layout(layout: str, steps: int, out: Path) -> None:
    """Train one layout on this rank and write its record."""
    mode, opt, groups = parse(layout)
    tp = 2 if mode == "tp2" else 1
    spec = TrainingSpec(steps=steps, batch_size=GLOBAL * tp // dist.get_world_size(),
                        seq_len=SEQ, grad_clip=0.0, weight_decay=0.0, local_groups=groups,
                        **OPTIMIZERS[opt])  # type: ignore[arg-type]
    model = _model(mode)
    record = {f"init.{n}": p.detach().clone() for n, p in model.named_parameters()}
    hsdp = mode.startswith("hsdp")
    pm = parallelize(model, tp, torch.device("cpu"), "hsdp" if hsdp else "fsdp" if tp > 1
                     else mode, shard_group=int(mode[4:]) if hsdp else None,
                     groups=groups.groups if groups else 1)
    assert pm.mesh is not None
    r, b = pm.dp_rank, spec.batch_size
    masked = layout.endswith(",masked")
    mine = iter([(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])
                 for x, y in global_batches(steps, masked)])
    for name, p in pm.module.named_parameters():
        local = getattr(p, "to_local", None)
        record[f"local.{name}"] = (local() if callable(local) else p).detach().clone()
    optimizer = make_optimizer(pm.module, spec)
    scheduler = make_scheduler(optimizer, spec, offset=0, total=steps)
    sync = make_sync(groups, pm, optimizer, steps)
    result = run_steps(pm, optimizer, scheduler, mine, steps, spec, torch.device("cpu"),
                       after_step=chain(sync, None), masked=masked)
    if sync is not None:
        sync.finish()
    record["losses"] = result.losses.double()
    for name, p in pm.module.named_parameters():
        record[f"weight.{name}"] = _full(p)
    out.mkdir(parents=True, exist_ok=True)
    save_file(record, str(out / f"rank{dist.get_rank()}.safetensors"), metadata={
        "dims": ",".join(pm.mesh.mesh_dim_names or ()),
        "shape": ",".join(str(s) for s in pm.mesh.mesh.shape),
        "dp_rank": str(r), "group": str(pm.group),
        "metrics": json.dumps(sync.metrics() if sync is not None else {})})


def warm_imports(argv: list[str]) -> None:
    """The tiny-test model's code (the tp2 layouts'), imported once before the ranks fork."""
    if any(layout.startswith("tp2") for layout in argv[2:]):
        warm_presets(["tiny-test"])


def main(out: Path, steps: int, layouts: list[str]) -> None:
    """Run every layout in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for layout in layouts:
        run_layout(layout, steps, out / layout.replace(",", "-"))
    dist.barrier()  # leave together (see tests/training/tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
