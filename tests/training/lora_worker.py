"""Per-rank worker for the LoRA data-parallel test: one launch of 2 ranks.

Usage, from the repository's root: ``python -m xffl.training.forked --nproc-per-node 2 -m
tests.training.lora_worker ADAPTER BASE DATA OUT JOB.json...`` (torchrun's engine, ranks
forked from one interpreter, as xffl starts CPU ranks):
in one gloo process group, xffl's trainer runs the round of each TrainJob file in turn
(their ``training.data_parallel`` differs), from the global adapter ADAPTER on the frozen
BASE, writing ``OUT/<job file's stem>``, and what each rank really trained
(``tp_worker.structure`` of the model the trainer built: FSDP2 modules, DTensor
parameters and their placements, whether DDP wrapped it, a frozen base weight's local
elements) in
``OUT/<job file's stem>.rank<k>.json``. One launch for every job saves a torch and peft
start-up per rank and job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.training.tp_worker import structure
from xffl.training import distributed as xdist
from xffl.training import trainer
from xffl.training.config import TrainJob
from xffl.training.parallelize import ParallelModel, is_dtensor


def frozen_weight(pm: ParallelModel) -> dict[str, Any]:
    """A frozen base weight of the first decoder layer: its elements, and this rank's."""
    name, param = next((n, p) for n, p in pm.module.named_parameters()
                       if n.endswith("layers.0.self_attn.q_proj.base_layer.weight"))
    local = param.to_local() if is_dtensor(param) else param  # type: ignore[attr-defined]
    return {"frozen_name": name, "frozen_numel": param.numel(),
            "frozen_local_numel": local.numel(), "frozen_grad": param.requires_grad}


def main(adapter: Path, base: Path, data: Path, out: Path, jobs: list[Path]) -> None:
    """Train every job's round in turn under one process group."""
    xdist.setup()
    out.mkdir(parents=True, exist_ok=True)
    built = trainer.site_model
    seen: list[ParallelModel] = []

    def recorded(*args: Any, **kwargs: Any) -> ParallelModel:
        # the trainer's own site_model, unchanged: only what it returns is noted
        pm = built(*args, **kwargs)
        seen.append(pm)
        return pm

    trainer.site_model = recorded
    for path in jobs:
        job = TrainJob.model_validate_json(path.read_bytes())
        trainer.train_round(job, 1, adapter, data, out / path.stem, base_dir=base)
        (pm,) = seen  # one model per round
        ran = {**structure(pm), "ddp": isinstance(pm.net, DistributedDataParallel),
               **frozen_weight(pm)}
        (out / f"{path.stem}.rank{dist.get_rank()}.json").write_text(json.dumps(ran))
        seen.clear()
    dist.barrier()  # every rank leaves together (see tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:5]), [Path(p) for p in sys.argv[5:]])
