"""An independent numpy reference of local SGD and DiLoCo on the groups worker's Bigram.

Float64 numpy: the model's forward and backward (embedding, linear head, mean cross-entropy
over a group's rows) and AdamW as torch defines it (betas 0.9/0.95, bias corrections, eps
added after sqrt(v_hat)), run per group on that group's rows, with the groups' average (or
DiLoCo's outer Nesterov step) every K steps and after the last one. No torch, no xffl code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]
BETAS = (0.9, 0.95)


def loss_and_grads(embed: Array, head: Array, x: NDArray[np.int64],
                   y: NDArray[np.int64]) -> tuple[float, Array, Array]:
    """Mean cross-entropy of ``head @ embed[x]`` against ``y`` (targets -100 left out) and
    its gradients."""
    h = embed[x]  # (B, S, H)
    logits = h @ head.T  # (B, S, V)
    logits = logits - logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    kept = y != -100
    t = np.where(kept, y, 0)
    n = int(kept.sum())
    loss = -float((np.take_along_axis(logp, t[..., None], axis=-1)[..., 0] * kept).sum()) / n
    d = np.exp(logp)
    np.put_along_axis(d, t[..., None], np.take_along_axis(d, t[..., None], axis=-1) - 1.0,
                      axis=-1)
    d *= kept[..., None] / n
    g_head = d.reshape(-1, head.shape[0]).T @ h.reshape(-1, h.shape[-1])
    g_embed = np.zeros_like(embed)
    np.add.at(g_embed, x.ravel(), (d @ head).reshape(-1, h.shape[-1]))
    return loss, g_embed, g_head


@dataclass
class Adam:
    """torch's AdamW (no weight decay) on a list of arrays."""

    lr: float
    eps: float
    m: list[Array] = field(default_factory=list)
    v: list[Array] = field(default_factory=list)
    t: int = 0

    def step(self, weights: list[Array], grads: list[Array]) -> list[Array]:
        """The weights after one step."""
        if not self.m:
            self.m = [np.zeros_like(w) for w in weights]
            self.v = [np.zeros_like(w) for w in weights]
        self.t += 1
        b1, b2 = BETAS
        out = []
        for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            denom = np.sqrt(self.v[i]) / np.sqrt(1 - b2 ** self.t) + self.eps
            out.append(w - self.lr / (1 - b1 ** self.t) * self.m[i] / denom)
        return out


def local_sgd(init: list[Array], rows: list[list[tuple[NDArray[np.int64], NDArray[np.int64]]]],
              every: int, lr: float, eps: float, *, moments: bool = False,
              nesterov: tuple[float, float] | None = None) -> tuple[list[Array], Array]:
    """The final weights and the (steps, groups) losses of ``len(rows[0])`` groups each
    stepping on its own rows (``rows[step][group]``), averaged every ``every`` steps and
    after the last; ``moments``: also AdamW's; ``nesterov``: (outer lr, outer momentum)."""
    groups = len(rows[0])
    weights = [[w.copy() for w in init] for _ in range(groups)]
    opts = [Adam(lr, eps) for _ in range(groups)]
    anchor = [w.copy() for w in init]
    buf: list[Array] | None = None
    losses = np.zeros((len(rows), groups))

    def mean(arrays: list[list[Array]]) -> list[Array]:
        return [sum(a[i] for a in arrays) / groups for i in range(len(arrays[0]))]

    for step, batch in enumerate(rows):
        for a, (x, y) in enumerate(batch):
            loss, g_embed, g_head = loss_and_grads(*weights[a], x, y)
            losses[step, a] = loss
            weights[a] = opts[a].step(weights[a], [g_embed, g_head])
        if (step + 1) % every and step + 1 < len(rows):
            continue
        avg = mean(weights)
        if moments:
            m, v = mean([o.m for o in opts]), mean([o.v for o in opts])
            for o in opts:
                o.m, o.v = [t.copy() for t in m], [t.copy() for t in v]
        if nesterov is not None:  # torch's SGD(nesterov=True): buf = mu buf + g; g + mu buf
            outer_lr, mu = nesterov
            grad = [o - w for o, w in zip(anchor, avg, strict=True)]
            buf = grad if buf is None else [mu * b + g for b, g in zip(buf, grad, strict=True)]
            anchor = [o - outer_lr * (g + mu * b)
                      for o, g, b in zip(anchor, grad, buf, strict=True)]
            avg = anchor
        weights = [[w.copy() for w in avg] for _ in range(groups)]
    return weights[0], losses
