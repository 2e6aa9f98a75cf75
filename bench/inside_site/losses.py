"""The loss table of bench/inside_site: real site rounds on CPU, one per way of training.

Each mode is a set of ``training`` fields; the round is the site trainer real sites run
(``python -m xffl.training`` through :func:`xffl.training.launch.launch`, gloo, RANKS CPU
ranks), from the same round-0 global, data, seed and batches, for ``steps`` optimizer steps.
Reported per mode: the last step's training loss and the held-out loss of the update (the
site's ``data.validation`` share, never trained on), from the update's manifest. Federated
node groups (``training.local_groups``, K in 1, 8 and 64) are entries of :data:`MODES` as
FSDP2 and HSDP are; a new mode is one more.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xffl.aggregator import metrics as metric
from xffl.aggregator.exchange import verify_checkpoint
from xffl.training.checkpoint import init_global
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob, ValidationSpec
from xffl.training.launch import launch

RANKS = 4
# name -> the training fields that make the mode (FSDP first: the baseline)
MODES: dict[str, dict[str, Any]] = {
    "fsdp": {"data_parallel": "fsdp"},
    "hsdp 2 x 2": {"data_parallel": "hsdp", "shard_group": 2},
    **{f"groups 2, K={k}": {"data_parallel": "fsdp", "local_groups": {"groups": 2, "every": k}}
       for k in (1, 8, 64)},
}


def job_for(fields: dict[str, Any], data: Path, steps: int, preset: str) -> TrainJob:
    """The bench's round: ``preset``, the synthetic alpha language with 1/8 held out, 2
    sequences of 64 tokens per rank per step, AdamW at lr 3e-3, seed 0; plus ``fields``."""
    training = TrainingSpec(steps=steps, batch_size=2, seq_len=64, lr=3e-3, seed=0,
                            **fields)
    return TrainJob(run_id="inside-site", site="site", model=ModelSpec(preset=preset),
                    training=training,
                    data=DataSpec(path=str(data), synthetic="alpha",
                                  synthetic_sequences=RANKS * 2 * steps * 9 // 8 + 64,
                                  validation=ValidationSpec(fraction=0.125)))


@contextmanager
def ranks_to_stderr() -> Iterator[None]:
    """The ranks' step lines and the trainer's record to stderr (fd 2), so that stdout
    keeps the tables (and --json its one document)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_mode(name: str, fields: dict[str, Any], work: Path, steps: int,
             preset: str) -> dict[str, float]:
    """One round of mode ``name`` in ``work``; its losses and wall seconds."""
    global0 = work / "global0"
    if not global0.exists():
        init_global("inside-site", ModelSpec(preset=preset), 0, global0)
    job = job_for(fields, work / "data", steps, preset)
    where = work / name.replace(" ", "_")
    where.mkdir(parents=True, exist_ok=True)
    (where / "job.json").write_text(job.model_dump_json())
    out = where / "update"
    args = ["--job", str(where / "job.json"), "--round", "1", "--model", str(global0),
            "--out", str(out)]
    start = time.perf_counter()
    with ranks_to_stderr():
        rc = launch(RANKS, "torchrun", args, out)
    if rc != 0:
        raise RuntimeError(f"the {name} round failed (its ranks' output is above)")
    seconds = time.perf_counter() - start
    got = verify_checkpoint(out).metrics
    return {"loss_last": got[metric.LOSS_LAST], "val_loss": got[metric.VAL_LOSS_UPDATE],
            "val_loss_start": got[metric.VAL_LOSS], "seconds": seconds}


def loss_table(work: Path, steps: int, preset: str = "tiny-test",
               modes: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, float]]:
    """Every mode's round (in :data:`MODES` order unless ``modes``), from one global."""
    return {name: run_mode(name, fields, work, steps, preset)
            for name, fields in (modes or MODES).items()}
