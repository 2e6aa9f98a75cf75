"""A site's trained weights as the exchange sends them: in a narrower dtype, or as a delta.

``exchange.update: delta`` sends ``w_site - w_parent`` (the parent is the round's global
model, read back tensor by tensor from its checkpoint, so the site never holds two copies of
the model), ``exchange.dtype`` the type the tensors travel in. The difference is taken in
float32 and rounded once to the exchange's dtype; the coordinator adds it back to the global
it holds (:mod:`xffl.aggregator.decode`). A quantized exchange (int8, nf4, fp4) sends each
floating-point tensor as its blockwise codes and scales (:mod:`xffl.aggregator.quantize`),
with error feedback (:mod:`xffl.training.feedback`) when the exchange asks for it and the site
has a state folder to keep the residual in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from xffl.aggregator.codec import Codec, scale_name
from xffl.aggregator.quantize import dequantize, quantize
from xffl.aggregator.shards import ModelReader, open_model
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.training.feedback import Residuals

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensor(raw: np.ndarray, dtype: str) -> Tensor:
    """A global model's stored tensor as float32 (bf16 arrives as its bit pattern)."""
    if dtype == "BF16":
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(raw)).float()


def encode_update(state: dict[str, Tensor], parent_dir: Path, exchange: ExchangeSpec,
                  state_dir: Path | None = None, round: int = 0) -> dict[str, Tensor]:
    """``state`` (HF names) as the exchange sends it; entries are replaced one by one, so
    at most one extra tensor is alive at a time. Plain fp32 weights are returned as they are.

    A quantized exchange with error feedback keeps round ``round``'s residual in
    ``state_dir`` (never in what is returned); without ``state_dir`` there is none.
    """
    if exchange.plain:
        return state
    codec = exchange.codec
    if codec is not None:
        with open_model(Path(parent_dir)) as reader:
            return _quantized(state, reader, codec,
                              state_dir if exchange.feedback else None, round)
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


def _quantized(state: dict[str, Tensor], parent: ModelReader, codec: Codec,
               state_dir: Path | None, round: int) -> dict[str, Tensor]:
    """Every floating-point tensor's delta (plus the carried residual) as codes and scales."""
    names = sorted(n for n, t in state.items() if t.is_floating_point())
    residuals = None if state_dir is None else Residuals(
        state_dir, round, [(n, tuple(state[n].shape)) for n in names])
    try:
        for name in names:
            entry = parent.entry(name)
            base = _tensor(parent.raw(name), entry.dtype).reshape(entry.shape)
            value = (state[name].detach().float() - base).reshape(-1).numpy()
            carried = None if residuals is None else residuals.carried(name)
            if carried is not None:
                value = value + carried
            codes, scales = quantize(codec, value)
            del state[name]
            state[name] = torch.from_numpy(codes)
            state[scale_name(name)] = torch.from_numpy(scales)
            if residuals is not None:
                residuals.keep(name, value - dequantize(codec, codes, scales, value.size))
    except BaseException:
        if residuals is not None:
            residuals.abort()
        raise
    if residuals is not None:
        residuals.commit()
    return state
