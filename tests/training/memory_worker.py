"""Measure a training run's peak live tensor bytes per rank, for the memory model's tests.

Run under the forked launcher (``python -m xffl.training.forked --nproc-per-node 2 -m
tests.training.memory_worker OUT``), each rank of a gloo group trains the "state" shape of
tests/training/test_memory_model.py under DDP and writes its measured peak and the model's
estimate to ``OUT/rankN.json``.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from xffl.training.arch import PRESETS, apply_overrides
from xffl.training.config import TrainingSpec
from xffl.training.loop import make_scheduler, run_steps
from xffl.training.memory_model import Estimate, estimate, model_parts, site_layout
from xffl.training.model import build_model
from xffl.training.optimizer import make_optimizer
from xffl.training.parallelize import parallelize

#: a shape where weights, gradients and AdamW dominate (the DDP buckets then show)
STATE_SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4}


class LiveBytes(TorchDispatchMode):
    """The exact bytes of live tensor storage, and their peak, while the mode is on.

    Every op's output storage is counted once when it appears and uncounted when the storage
    is freed (a weakref finalizer: torch keeps one Python object per storage); storages made
    before (the weights) are added with :meth:`track`. In-place ops and views allocate
    nothing and add nothing. This counts what the allocator holds for tensors, without its
    caching or the process's other memory (what RSS would add).
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, value: object) -> None:
        """Count ``value``'s storage if it is a tensor not counted yet."""
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        storage = value.untyped_storage()
        if storage in self.seen:
            return
        self.seen[storage] = True
        weakref.finalize(storage, self._free, storage.nbytes())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self.track(leaf)
        return out


def measure(overrides: dict[str, int], batch: int, seq: int, ac: bool,
            ranks: int = 1) -> tuple[int, Estimate]:
    """Measured peak bytes of two real optimizer steps on this rank (fp32, AdamW; wrapped as
    the trainer wraps ``ranks`` ranks, DDP here), and the memory model's CPU estimate."""
    config = apply_overrides(PRESETS["tiny-test"], overrides)
    spec = TrainingSpec(batch_size=batch, seq_len=seq, activation_checkpointing=ac, steps=2)
    model = build_model(config, seed=1)
    if ac:  # as the trainer does
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    device = torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(rank)
        while True:
            tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
            yield tokens, tokens

    tracker = LiveBytes()
    for tensor in [*model.parameters(), *model.buffers()]:
        tracker.track(tensor)
    with tracker:  # from the wrapping on: DDP's buckets are made by its constructor
        pm = parallelize(model, 1, device, spec.data_parallel)
        optimizer = make_optimizer(pm.module, spec)
        scheduler = make_scheduler(optimizer, spec, 0, spec.steps)
        run_steps(pm, optimizer, scheduler, batches(), spec.steps, spec, device)
    parts = model_parts(config)
    return tracker.peak, estimate(parts, site_layout(spec, ranks, parts, gpu=False))


def main(out: Path) -> None:
    """Each rank of the gloo group: the state shape under DDP, its peak and estimate."""
    dist.init_process_group("gloo")
    peak, est = measure(STATE_SHAPE, 1, 16, False, ranks=dist.get_world_size())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"measured": peak, "estimate": est.peak, "phase": est.phase,
         "ddp_buckets": est.terms.get("ddp_buckets", 0)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
