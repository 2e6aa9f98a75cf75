"""Per-rank worker for the LoRA data-parallel test: run under torchrun, one launch.

Usage: ``torchrun --nproc-per-node 2 lora_worker.py ADAPTER BASE DATA OUT JOB.json...``:
in one gloo process group, xffl's trainer runs the round of each TrainJob file in turn
(their ``training.data_parallel`` differs), from the global adapter ADAPTER on the frozen
BASE, writing ``OUT/<job file's stem>``. One launch for every job saves a torch and peft
start-up per rank and job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from xffl.training import distributed as xdist
from xffl.training.config import TrainJob
from xffl.training.trainer import train_round


def main(adapter: Path, base: Path, data: Path, out: Path, jobs: list[Path]) -> None:
    """Train every job's round in turn under one process group."""
    xdist.setup()
    for path in jobs:
        job = TrainJob.model_validate_json(path.read_bytes())
        train_round(job, 1, adapter, data, out / path.stem, base_dir=base)
    dist.barrier()  # every rank leaves together (see tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:5]), [Path(p) for p in sys.argv[5:]])
