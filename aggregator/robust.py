"""Bounds on what one site can do to the global model: weight caps and update-norm clipping.

Checks prove an update is what a site sent, not that the site is honest. Two bounds limit a
site that lies within the checks, for the averaging strategies (FedAvg and the server
optimizers built on its mean):

* ``max_weight_share`` caps any site's share of the weights (water-filling: a capped site's
  excess goes to the others in proportion to their weights, again until none is over), so a
  site claiming a huge dataset cannot own the average;
* ``clip_norm`` scales each update's change ``u - x`` (x: the global the round started from)
  to an L2 norm of at most ``clip_norm`` over all floating-point tensors, so a site sending a
  huge update moves the mean by at most ``clip_norm`` times its share.

Together, one site moves the round's mean by at most ``clip_norm x max_weight_share``. The
robust strategies (fedmedian, fedtrimmedavg) bound a minority's influence by their own rule
and take neither option.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from xffl.aggregator.dtypes import FLOAT_DTYPES, decode
from xffl.aggregator.exchange import TensorInfo
from xffl.aggregator.shards import TensorReader
from xffl.core.errors import InvalidInput

_SLICE = 1 << 22  # elements per slice of a norm pass


def cap_shares(weights: Sequence[float], cap: float) -> list[float]:
    """``weights`` with no share above ``cap`` (the same total; shares as equal as possible).

    Water-filling: a site over the cap is set to it, the remainder shared by the others in
    proportion to their weights, repeated until no share exceeds the cap. With n sites and
    ``cap < 1/n`` no weighting fits: every site gets 1/n.
    """
    if not 0 < cap <= 1:
        raise InvalidInput(f"max_weight_share must be in (0, 1], got {cap}.")
    total = math.fsum(weights)
    n = len(weights)
    if n == 0 or total <= 0:
        return list(weights)
    if cap * n <= 1:
        return [total / n] * n
    shares = [w / total for w in weights]
    fixed: set[int] = set()
    while True:
        over = [i for i, s in enumerate(shares) if i not in fixed and s > cap]
        if not over:
            break
        fixed.update(over)
        free = [i for i in range(n) if i not in fixed]
        left = 1.0 - cap * len(fixed)
        free_total = math.fsum(weights[i] for i in free)
        for i in fixed:
            shares[i] = cap
        for i in free:
            shares[i] = left * weights[i] / free_total if free_total > 0 else left / len(free)
    return [s * total for s in shares]


def delta_norm(update: TensorReader, previous: TensorReader,
               layout: Sequence[TensorInfo]) -> float:
    """The L2 norm of ``update - previous`` over every floating-point tensor (float64)."""
    acc = 0.0
    for t in layout:
        if t.dtype not in FLOAT_DTYPES:
            continue
        numel = math.prod(t.shape)
        for lo in range(0, numel, _SLICE):
            hi = min(lo + _SLICE, numel)
            d = decode(update.raw(t.name, lo, hi), t.dtype) - decode(
                previous.raw(t.name, lo, hi), t.dtype)
            acc += float(np.dot(d, d))
    return math.sqrt(acc)


def clip_factors(norms: Sequence[float], clip_norm: float) -> list[float]:
    """Each update's scale: 1 when its change is within ``clip_norm``, else clip_norm/norm."""
    if not clip_norm > 0:
        raise InvalidInput(f"clip_norm must be positive, got {clip_norm}.")
    return [1.0 if n <= clip_norm else clip_norm / n for n in norms]
