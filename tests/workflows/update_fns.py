"""``training.update_fn`` stand-ins for the run tests (imported at the sites through PYTHONPATH)."""

from __future__ import annotations

import numpy as np

from xffl.training.streamed import UpdateContext, add_delta


def nan_at_beta(name: str, value: np.ndarray, context: UpdateContext) -> np.ndarray:
    """add_delta everywhere, but site beta's update holds a NaN (its admission must fail)."""
    value = add_delta(name, value, context)
    if context.site == "beta" and name == "model.norm.weight":
        value[0] = np.nan
    return value
