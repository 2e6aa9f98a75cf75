"""Models from a user's Python entry point (``package.module:function``) instead of a preset.

The function receives the job's :class:`~xffl.training.arch.ModelConfig` (the preset with
its overrides, which also sets the vocabulary and the longest sequence) and returns a
``torch.nn.Module`` whose ``forward(input_ids)`` gives logits of shape (batch, seq, vocab).
Its ``state_dict`` is what travels between sites, as safetensors. Tensor parallelism and
activation checkpointing need xffl's LLaMA module tree; data parallelism works for any
module. The module must be importable on every site (install it, or set PYTHONPATH in the
site profile's ``env``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from xffl.core.errors import InvalidInput
from xffl.training.arch import ModelConfig
from xffl.training.config import check_entry_point
from xffl.training.model import build_model


def load_builder(entry_point: str) -> Callable[[ModelConfig], nn.Module]:
    """Import the function an entry point names; InvalidInput saying what is wrong."""
    module_name, _, attr = check_entry_point(entry_point).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(
            f"model.entry_point {entry_point}: cannot import {module_name} ({exc}); install "
            "it at every site or add its folder to PYTHONPATH in the site profile's env."
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InvalidInput(f"model.entry_point {entry_point}: {module_name} has no function "
                           f"{attr}; name a function that takes a ModelConfig.")
    return fn  # type: ignore[no-any-return]


def build(config: ModelConfig, entry_point: str | None = None,
          seed: int | None = None) -> nn.Module:
    """A float32 CPU model: xffl's LLaMA, or the entry point's (seeded when ``seed`` is set)."""
    if entry_point is None:
        return build_model(config, seed=seed)
    builder = load_builder(entry_point)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        model = builder(config)
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model.entry_point {entry_point} returned "
                           f"{type(model).__name__}, not a torch.nn.Module.")
    return model.float()
