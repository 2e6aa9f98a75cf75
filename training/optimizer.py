"""The optimizer of a site's round and the per-rank seeds of its data order."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from xffl.training.config import TrainingSpec


def make_optimizer(model: nn.Module, spec: TrainingSpec) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.95); weight decay on matrices only, not on norm weights; torch's
    fused kernel when the parameters are on CUDA (fp32 master weights and states)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=spec.adam_eps,
                             fused=fused or None)


def rank_seed(seed: int, round: int, dp_rank: int) -> int:
    """The torch seed of one dp rank in one round (a stable hash, not Python's hash())."""
    digest = hashlib.sha256(f"xffl:{seed}:{round}:{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)
