"""Shared fixtures of the training tests: a tiny job and its round-0 global checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from xffl.aggregator.exchange import Manifest
from xffl.training.checkpoint import init_global
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob


def _make_job(data_dir: Path, *, language: str = "alpha", sequences: int = 64, steps: int = 4,
             batch_size: int = 2, seq_len: int = 16, lr: float = 3e-3, seed: int = 0,
             site: str = "site-a", adam_eps: float = 1e-8) -> TrainJob:
    """A TrainJob for the tiny-test preset on a synthetic dataset."""
    return TrainJob(
        run_id="run-test",
        site=site,
        model=ModelSpec(preset="tiny-test"),
        training=TrainingSpec(steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                              seed=seed, adam_eps=adam_eps),
        data=DataSpec(path=str(data_dir), synthetic=language, synthetic_sequences=sequences),
    )


@pytest.fixture
def make_job() -> Callable[..., TrainJob]:
    """The TrainJob factory (tests cannot import conftest under importlib mode)."""
    return _make_job


@pytest.fixture
def global0(tmp_path: Path) -> tuple[Path, Manifest]:
    """A round-0 global checkpoint of the tiny-test preset (seed 0)."""
    out = tmp_path / "global0"
    return out, init_global("run-test", ModelSpec(preset="tiny-test"), 0, out)


@pytest.fixture
def tokenizer_json(tmp_path: Path, texts: list[Path]) -> Path:
    """A small BPE tokenizer trained with the tokenizers library on the module's ``texts``,
    saved as tokenizer.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(p) for p in texts],
              trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path
