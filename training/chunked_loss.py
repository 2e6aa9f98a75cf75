"""Next-token cross-entropy without the full logits: the LM head applied chunk by chunk.

The full fp32 logits of a micro-batch are tokens x vocabulary x 4 bytes (8192 tokens at a
128K vocabulary: 4.2 GB, with log-softmax and its gradient two or three times that). Here the
decoder's final hidden states go through the head ``chunk`` tokens at a time; each chunk's
logits are upcast to fp32 (right whether the head runs in bf16 or fp32), reduced to the sum of
its token losses, and dropped. Under autograd each chunk runs under
``torch.utils.checkpoint`` (non-reentrant), which keeps only the chunk's hidden states and
recomputes its logits in backward, so at most one chunk's logits are alive in forward or
backward: a few ``chunk x vocab x 4`` bytes instead of ``tokens x vocab x 4`` (one extra
head matmul per chunk, about 2 % of an 8B model's training FLOPs).

The loss is computed inside the model's own ``forward`` (:func:`install`), so that FSDP2's
root unit has its parameters (the head, the embeddings) unsharded and DDP sees the head used
in its forward. The head stays out of the tensor-parallel plan (replicated on every tp rank),
so the chunks see whole rows of logits. A model this does not cover (a ``model.entry_point``
module, a family that changes the head's logits in ways not handled here) keeps the full-
logits path through :func:`loss_sum`.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK", "chunked_cross_entropy", "install", "loss_sum", "supports"]

#: tokens per chunk: 1024 x 128256 x 4 B = 0.5 GB of fp32 chunk logits at Llama 3's vocabulary
DEFAULT_CHUNK = 1024
IGNORE = -100  # a target out of the loss (xffl.training.data.IGNORE)
_MARK = "_xffl_chunked_loss"
# families whose causal-LM forward is lm_head(last_hidden_state), then at most a soft-cap
# (tests/training/test_chunked_loss.py checks each against the family's own logits)
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma2"})


def _chunk_loss(hidden: Tensor, targets: Tensor, head: nn.Module, softcap: float | None) -> Tensor:
    """Sum of the cross-entropies of one chunk's targets (not -100), from fp32 logits."""
    logits = head(hidden).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE)


def chunked_cross_entropy(hidden: Tensor, head: nn.Module, targets: Tensor, chunk: int,
                          softcap: float | None = None) -> Tensor:
    """Sum over targets != -100 of -log softmax(head(hidden))[target], ``chunk`` tokens at a time.

    ``hidden``: (..., H) final hidden states; ``targets``: (...) next-token ids; ``chunk`` <= 0
    (or >= the token count) applies the head to all tokens at once. The chunks' sums are
    added in fp32, in order.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = targets.reshape(-1)
    count = flat.shape[0]
    if chunk <= 0 or chunk >= count:
        return _chunk_loss(flat, labels, head, softcap)
    recompute = torch.is_grad_enabled()
    total: Tensor | None = None
    for start in range(0, count, chunk):
        rows = slice(start, start + chunk)
        part = (checkpoint(_chunk_loss, flat[rows], labels[rows], head, softcap,
                           use_reentrant=False) if recompute
                else _chunk_loss(flat[rows], labels[rows], head, softcap))
        assert isinstance(part, Tensor)
        total = part if total is None else total + part
    assert total is not None
    return total


def _forward(self: nn.Module, input_ids: Tensor | None = None, *,
             loss_targets: Tensor | None = None, loss_chunk: int = DEFAULT_CHUNK,
             **kwargs: Any) -> Any:
    """The model's forward; with ``loss_targets``, the summed token loss instead of logits."""
    if loss_targets is None:
        return type(self).forward(self, input_ids, **kwargs)
    given = {k: v for k, v in kwargs.items() if v is not None}  # peft passes labels=None, ...
    decoder = self.get_decoder()  # type: ignore[operator]
    hidden = decoder(input_ids=input_ids, **given).last_hidden_state
    softcap = getattr(self.config, "final_logit_softcapping", None)
    return chunked_cross_entropy(hidden, self.get_output_embeddings(),  # type: ignore[operator]
                                 loss_targets, loss_chunk, softcap)


def install(model: nn.Module) -> None:
    """Let ``model(ids, loss_targets=t, loss_chunk=c)`` return the chunked loss sum.

    Only for a transformers causal LM of :data:`FAMILIES`; others are left as they are.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES:
        return
    model.forward = MethodType(_forward, model)
    setattr(model, _MARK, True)


def supports(net: nn.Module) -> bool:
    """Whether ``net`` (or the model DDP, FSDP2 or peft wraps in it) computes chunked losses."""
    return any(getattr(m, _MARK, False) for m in net.modules())


def full_logits_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Sum of the token cross-entropies from whole logits (upcast to fp32 at once)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           reduction="sum", ignore_index=IGNORE)


def loss_sum(net: nn.Module, inputs: Tensor, targets: Tensor, chunk: int,
             chunked: bool | None = None, **extra: Tensor) -> Tensor:
    """Sum of the token losses of ``net`` on ``inputs`` (targets -100 skipped).

    Chunked when ``net`` supports it (``chunked``: :func:`supports`, computed once by a caller
    that loops), else from its full logits (a ``model.entry_point`` model).
    """
    if supports(net) if chunked is None else chunked:
        out: Tensor = net(inputs, loss_targets=targets, loss_chunk=chunk, **extra)
        return out
    return full_logits_loss(net(inputs, **extra), targets)
