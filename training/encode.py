"""A site's trained weights as the exchange sends them: in a narrower dtype, or as a delta.

``exchange.update: delta`` sends ``w_site - w_parent`` (the parent is the round's global
model, read back tensor by tensor from its checkpoint, so the site never holds two copies of
the model), ``exchange.dtype`` the type the tensors travel in. The difference is taken in
float32 and rounded once to the exchange's dtype; the coordinator adds it back to the global
it holds (:mod:`xffl.aggregator.decode`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from xffl.aggregator.shards import open_model
from xffl.training.config import ExchangeSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensor(raw: np.ndarray, dtype: str) -> Tensor:
    """A global model's stored tensor as float32 (bf16 arrives as its bit pattern)."""
    if dtype == "BF16":
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(raw)).float()


def encode_update(state: dict[str, Tensor], parent_dir: Path,
                  exchange: ExchangeSpec) -> dict[str, Tensor]:
    """``state`` (HF names) as the exchange sends it; entries are replaced one by one, so
    at most one extra tensor is alive at a time. Plain fp32 weights are returned as they are."""
    if exchange.plain:
        return state
    target = TORCH_DTYPES[exchange.dtype]
    parent = open_model(Path(parent_dir)) if exchange.update == "delta" else None
    try:
        for name in list(state):
            weight = state[name].detach()
            if not weight.is_floating_point():
                continue
            value = weight.float()
            if parent is not None:
                entry = parent.entry(name)
                base = _tensor(parent.raw(name), entry.dtype).reshape(entry.shape)
                value = value - base
            state[name] = value.to(target).contiguous()
    finally:
        if parent is not None:
            parent.close()
    return state
