"""Per-rank worker for the LoRA-under-FSDP2 tests (tests/training/test_lora_fsdp.py).

Usage, from the repository's root: ``python -m xffl.training.forked --nproc-per-node 2 -m
tests.training.lora_fsdp_worker OUT CASE...``, a CASE being ``NAME:BASE:ADAPTER:JOB.json``.
For each case in turn, under one gloo process group, the trainer's own ``site_model`` builds
the job's LoRA model (FSDP2 at dp 2) while torch's profiler counts this rank's CPU tensor
allocations; then :func:`train` runs the job's steps on the fixed global batches of
:func:`global_batches` (dp rank r takes its consecutive rows) through xffl's loop, and
rank 0 writes the trained adapter to ``OUT/NAME.safetensors``. What each rank built and its
load peak go to ``OUT/NAME.rank<k>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from xffl.training import distributed as xdist
from xffl.training import lora, trainer
from xffl.training.checkpoint import read_config
from xffl.training.config import TrainJob
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import ParallelModel, decoder_layers, is_dtensor


def global_batches(vocab: int, steps: int, rows: int, seq: int) -> list[tuple[Tensor, Tensor]]:
    """``steps`` global batches of ``rows`` random sequences (the same on every rank)."""
    gen = torch.Generator().manual_seed(11)
    return [(torch.randint(0, vocab, (rows, seq), generator=gen),
             torch.randint(0, vocab, (rows, seq), generator=gen)) for _ in range(steps)]


def train(pm: ParallelModel, job: TrainJob, vocab: int, rows: int) -> dict[str, Tensor]:
    """The job's steps on this dp rank's rows of :func:`global_batches`; the trained adapter
    (peft's names, fp32) on rank 0 ({} elsewhere)."""
    spec = job.training
    b = rows // pm.dp_size
    mine = iter([(x[pm.dp_rank * b:(pm.dp_rank + 1) * b], y[pm.dp_rank * b:(pm.dp_rank + 1) * b])
                 for x, y in global_batches(vocab, spec.steps, rows, spec.seq_len)])
    optimizer = make_optimizer(pm.module, spec)
    scheduler = make_scheduler(optimizer, spec, offset=0, total=spec.steps)
    run_steps(pm, optimizer, scheduler, mine, spec.steps, spec, torch.device("cpu"))
    return lora.adapter_state(pm.module, pm.full_state_dict(lora.is_adapter_param))


def peak_bytes(prof: profile) -> int:
    """The most bytes of CPU tensors alive at once while ``prof`` ran (its memory events,
    in time order: an op's own allocations, and the frees it records as ``[memory]``)."""
    live = peak = 0
    for event in sorted(prof.profiler.function_events, key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else \
            event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def built(pm: ParallelModel) -> dict[str, Any]:
    """What a rank holds: FSDP2 units, and its local and global elements and bytes of the
    frozen base and of the adapter, with their dtypes."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, Any] = {
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in pm.module.modules()),
        "layers": len(decoder_layers(pm.module)), "dp": pm.dp_size}
    for part in ("frozen", "adapter"):
        params = [(n, p) for n, p in pm.module.named_parameters()
                  if lora.is_adapter_param(n) == (part == "adapter")]
        local = [p.to_local() if is_dtensor(p) else p for _, p in params]  # type: ignore[attr-defined]
        out[part] = {
            "dtypes": sorted({str(p.dtype) for _, p in params}),
            "numel": sum(p.numel() for _, p in params),
            "local_numel": sum(t.numel() for t in local),
            "local_bytes": sum(t.numel() * t.element_size() for t in local),
            "largest_fp32_bytes": max(p.numel() for _, p in params) * 4,
            "sharded": all(is_dtensor(p) and p.to_local().numel() * pm.dp_size  # type: ignore[attr-defined]
                           == p.numel() for _, p in params if p.shape[0] % pm.dp_size == 0),
        }
    return out


def main(out: Path, cases: list[str]) -> None:
    """Load and train every case in turn under one process group."""
    xdist.setup()
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:
        name, base, adapter, job_file = case.split(":")
        job = TrainJob.model_validate_json(Path(job_file).read_bytes())
        config = read_config(Path(base))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            pm = trainer.site_model(job, Path(base), Path(adapter), config,
                                    torch.device("cpu"))
        ran = {**built(pm), "load_peak_bytes": peak_bytes(prof)}
        (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(ran))
        state = train(pm, job, config.vocab_size, rows=4)
        if dist.get_rank() == 0:
            save_file(state, str(out / f"{name}.safetensors"))
    dist.barrier()  # every rank leaves together (see tp_worker.py)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
