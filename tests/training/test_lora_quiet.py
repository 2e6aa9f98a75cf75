"""Wrapping a model in its LoRA adapter warns nothing: no transformers FutureWarning in every
LoRA site's log (issue 44)."""

from __future__ import annotations

import warnings
from pathlib import Path

from xffl.aggregator.exchange import Manifest
from xffl.training import lora
from xffl.training.checkpoint import load_model
from xffl.training.config import LoraSpec


def test_wrapping_in_lora_warns_nothing(global0: tuple[Path, Manifest]) -> None:
    """peft's get_peft_model read transformers' deprecated ``is_gradient_checkpointing``,
    whose FutureWarning every rank of every LoRA site printed once a round."""
    model = load_model(global0[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora.wrap(model, LoraSpec(r=4, alpha=8.0), freeze_a=False)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
