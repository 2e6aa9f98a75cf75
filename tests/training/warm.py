"""Warm-up for the forked test workers: the model code imported once, before the ranks fork.

``python -m xffl.training.forked`` calls a worker module's ``warm_imports(argv)`` before it
forks the ranks, as it calls the trainer's own (:func:`xffl.training.model.warm_imports`).
Building a family's model on the meta device runs transformers' construction code (its lazy
modules, the family's modeling file) with no tensor memory and no thread: every forked rank
then finds that code imported instead of importing it again (about 1.5 s of CPU per rank;
a 4-rank launch of tests/training/hsdp_worker.py took 11.0 CPU-s without it, 6.0 with it).
"""

from __future__ import annotations

from collections.abc import Iterable

from xffl.training.arch import build_config
from xffl.training.config import ModelSpec
from xffl.training.model import meta_model, warm_family


def warm_presets(presets: Iterable[str]) -> None:
    """Build each preset's model once on the meta device (imports only; no tensors)."""
    for preset in dict.fromkeys(presets):
        config = build_config(ModelSpec(preset=preset))
        warm_family(config.model_type)  # what a load and a forward run, as the trainer warms
        meta_model(config)
