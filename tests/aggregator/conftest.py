"""Fixtures for the aggregator tests: small update checkpoints written in the exchange format."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from xffl.aggregator.exchange import Manifest, finalize_manifest, staged_dir

MakeUpdate = Callable[..., Path]


def write_checkpoint(
    directory: Path,
    tensors: Mapping[str, np.ndarray | torch.Tensor],
    *,
    kind: str = "update",
    site: str | None = "site",
    num_samples: int = 1,
    num_tokens: int = 0,
    round: int = 1,
    parent: str | None = None,
    run_id: str = "run-1",
    metrics: Mapping[str, float] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory (model.safetensors, config.json, manifest.json)."""
    as_torch = {
        k: v.contiguous() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))
        for k, v in tensors.items()
    }
    with staged_dir(directory) as tmp:
        save_file(as_torch, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config or {"hidden_size": 8}))
        finalize_manifest(
            tmp,
            Manifest(
                kind=kind,  # type: ignore[arg-type]
                site=site,
                num_samples=num_samples,
                num_tokens=num_tokens,
                round=round,
                parent=parent,
                run_id=run_id,
                metrics=dict(metrics or {}),
            ),
        )
    return directory


@pytest.fixture
def make_update(tmp_path: Path) -> MakeUpdate:
    """A factory: make_update(site, tensors, **manifest fields) -> update directory."""

    def make(site: str, tensors: Mapping[str, Any], **fields: Any) -> Path:
        name = fields.pop("dirname", site)
        return write_checkpoint(tmp_path / "updates" / name, tensors, site=site, **fields)

    return make


@pytest.fixture
def write_ckpt() -> Callable[..., Path]:
    """write_checkpoint itself, for tests that need a global checkpoint or full control."""
    return write_checkpoint
