"""Per-rank worker for the HSDP test: FSDP2 over all ranks, then HSDP, in one process group.

Usage: ``python -m xffl.training.forked --nproc-per-node 4 -m tests.training.hsdp_worker OUT
MODE[:SHARD_GROUP] ...``. For each layout in turn: the tiny-test model (seed 1) through
xffl's own :func:`~xffl.training.parallelize.parallelize` (``fsdp``, or ``hsdp`` with
``shard_group`` SHARD_GROUP), STEPS optimizer steps of xffl's loop on a fixed global batch
(rank r takes its GLOBAL / world consecutive rows: the same rows under both layouts), then
``OUT/MODE/rank<k>.safetensors``: the step losses, the full weights, and each parameter's
local shard; the mesh's dimension names and shape and the placements in its metadata.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize

GLOBAL, SEQ, STEPS = 8, 16, 3
# adam_eps 1 (>> |g|): AdamW's step is Lipschitz in the gradient (<= lr / eps per unit of
# gradient change), so the fp32 rounding of a reduction cannot flip a step's sign
SPEC = TrainingSpec(steps=STEPS, batch_size=GLOBAL, seq_len=SEQ, lr=0.1, adam_eps=1.0,
                    grad_clip=0.0, weight_decay=0.0)


def run_layout(layout: str, out: Path) -> None:
    """Train the layout ``MODE[:SHARD_GROUP]`` on this rank and write its record."""
    mode, *group = layout.split(":")
    config = build_config(ModelSpec(preset="tiny-test"))
    pm = parallelize(build_model(config, seed=1), 1, torch.device("cpu"), mode,
                     shard_group=int(group[0]) if group else None)
    assert pm.mesh is not None
    r, n = pm.dp_rank, pm.dp_size
    b = GLOBAL // n
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, config.vocab_size, (GLOBAL, SEQ), generator=gen),
             torch.randint(0, config.vocab_size, (GLOBAL, SEQ), generator=gen))
            for _ in range(STEPS)]
    mine = iter([(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for x, y in data])
    record: dict[str, torch.Tensor] = {}
    placements = set()
    for name, p in pm.module.named_parameters():
        assert isinstance(p, DTensor), name
        record[f"local.{name}"] = p.to_local().detach().clone()
        record[f"shape.{name}"] = torch.tensor(tuple(p.shape))
        placements.add(str(p.placements))
    optimizer = make_optimizer(pm.module, SPEC)
    scheduler = make_scheduler(optimizer, SPEC, offset=0, total=STEPS)
    result = run_steps(pm, optimizer, scheduler, mine, STEPS, SPEC, torch.device("cpu"))
    record["losses"] = result.losses.double()
    for name, p in pm.module.named_parameters():
        assert isinstance(p, DTensor)
        record[f"weight.{name}"] = p.full_tensor().detach().float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    mesh = pm.mesh
    save_file(record, str(out / f"rank{dist.get_rank()}.safetensors"),
              metadata={"dims": ",".join(mesh.mesh_dim_names or ()),
                        "shape": ",".join(str(s) for s in mesh.mesh.shape),
                        "placements": ";".join(sorted(placements)),
                        "dp_rank": str(r), "dp_size": str(n)})


def main(out: Path, layouts: list[str]) -> None:
    """Run every layout in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for layout in layouts:
        run_layout(layout, out / layout.replace(":", "-"))
    dist.barrier()  # leave together (see tests/training/tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
