"""Per-rank worker for the HSDP test: FSDP2 over all ranks, then HSDP, in one process group.

Usage: ``python -m xffl.training.forked --nproc-per-node 4 -m tests.training.hsdp_worker OUT
MODE[:SHARD_GROUP][/TP][+sharded] ...``. For each layout in turn: the tiny-test model (seed 1)
through xffl's own :func:`~xffl.training.parallelize.parallelize` (``fsdp``, or ``hsdp`` with
``shard_group`` SHARD_GROUP; tensor_parallel TP, 1 by default; ``+sharded``: round 0's
checkpoint of the same weights loaded into the mesh's slices as a site loads it, and the
update gathered as a site saves it checked against the parameters), STEPS optimizer steps of
xffl's loop on a fixed global batch (dp rank r takes its GLOBAL / dp consecutive rows: the
same rows under every layout of the same dp), then ``OUT/LAYOUT/rank<k>.safetensors`` (``:``
and ``/`` as ``-``): the step losses, the full weights, and each parameter's local shard (and,
``+sharded``, the loaded parameters put together from the slices before the first step);
the mesh's dimension names and shape, the placements and the ranks of this rank's group
along every mesh dimension in its metadata.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from tests.training.warm import warm_presets
from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec, TrainingSpec
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize
from xffl.training.sharded_load import load_parallel

GLOBAL, SEQ, STEPS = 8, 16, 3
# adam_eps 1 (>> |g|): AdamW's step is Lipschitz in the gradient (<= lr / eps per unit of
# gradient change), so the fp32 rounding of a reduction cannot flip a step's sign
SPEC = TrainingSpec(steps=STEPS, batch_size=GLOBAL, seq_len=SEQ, lr=0.1, adam_eps=1.0,
                    grad_clip=0.0, weight_decay=0.0)


def run_layout(layout: str, out: Path) -> None:
    """Train the layout ``MODE[:SHARD_GROUP][/TP][+sharded]`` on this rank; write its record."""
    sharded = layout.endswith("+sharded")
    dp_layout, _, tp = layout.removesuffix("+sharded").partition("/")
    mode, *group = dp_layout.split(":")
    spec = ModelSpec(preset="tiny-test")
    config = build_config(spec)
    shard_group = int(group[0]) if group else None
    if sharded:
        if dist.get_rank() == 0:
            init_global("hsdp", spec, 1, out / "global0")
        dist.barrier()
        pm = load_parallel(out / "global0", config, int(tp or 1), torch.device("cpu"), mode,
                           shard_group=shard_group)
    else:
        pm = parallelize(build_model(config, seed=1), int(tp or 1), torch.device("cpu"), mode,
                         shard_group=shard_group)
    assert pm.mesh is not None
    r, n = pm.dp_rank, pm.dp_size
    b = GLOBAL // n
    gen = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, config.vocab_size, (GLOBAL, SEQ), generator=gen),
             torch.randint(0, config.vocab_size, (GLOBAL, SEQ), generator=gen))
            for _ in range(STEPS)]
    mine = iter([(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for x, y in data])
    record: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for name, p in pm.module.named_parameters():
        assert isinstance(p, DTensor), name
        record[f"local.{name}"] = p.to_local().detach().clone()
        record[f"shape.{name}"] = torch.tensor(tuple(p.shape))
        where[f"placement.{name}"] = str(p.placements)
        if sharded:  # the loaded slices put together, before any step
            record[f"loaded.{name}"] = p.full_tensor().detach().float().contiguous()
    optimizer = make_optimizer(pm.module, SPEC)
    scheduler = make_scheduler(optimizer, SPEC, offset=0, total=STEPS)
    result = run_steps(pm, optimizer, scheduler, mine, STEPS, SPEC, torch.device("cpu"))
    record["losses"] = result.losses.double()
    for name, p in pm.module.named_parameters():
        assert isinstance(p, DTensor)
        record[f"weight.{name}"] = p.full_tensor().detach().float().contiguous()
    update = pm.full_state_dict()  # the site's update save: rank 0 holds it
    if dist.get_rank() == 0:
        assert update and all(torch.equal(t, record[f"weight.{k}"]) for k, t in update.items())
    out.mkdir(parents=True, exist_ok=True)
    mesh = pm.mesh
    groups = {f"group.{dim}": ",".join(str(k) for k in mesh[dim].mesh.tolist())
              for dim in mesh.mesh_dim_names or ()}
    save_file(record, str(out / f"rank{dist.get_rank()}.safetensors"),
              metadata={"dims": ",".join(mesh.mesh_dim_names or ()),
                        "shape": ",".join(str(s) for s in mesh.mesh.shape),
                        "placements": ";".join(sorted(set(where.values()))), **where,
                        "dp_rank": str(r), "dp_size": str(n), "tp_size": str(pm.tp_size),
                        **groups})


def warm_imports(argv: list[str]) -> None:
    """The model code every layout runs, imported once before the ranks fork."""
    warm_presets(["tiny-test"])


def main(out: Path, layouts: list[str]) -> None:
    """Run every layout in turn in one gloo process group."""
    dist.init_process_group("gloo")
    for layout in layouts:
        run_layout(layout, out / layout.replace(":", "-").replace("/", "-"))
    dist.barrier()  # leave together (see tests/training/tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
