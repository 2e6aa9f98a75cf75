"""The tensor names of a LoRA adapter checkpoint, as peft saves them (no torch needed).

peft's ``get_peft_model_state_dict`` names the two factors of the adapter on module ``M``
``base_model.model.M.lora_A.weight`` (shape ``(r, in_features)``) and
``base_model.model.M.lora_B.weight`` (``(out_features, r)``); the adapted layer computes
``W x + (alpha / r) B A x``. The coordinator writes round 0's adapter under these names,
the sites send them back, and ``xffl export --merge`` folds them into ``M.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable

from xffl.aggregator.exchange import TensorInfo

PREFIX = "base_model.model."
A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"


def factor_names(module: str) -> tuple[str, str]:
    """The names of module ``module``'s A and B factors in an adapter checkpoint."""
    return f"{PREFIX}{module}{A_SUFFIX}", f"{PREFIX}{module}{B_SUFFIX}"


def adapted_modules(names: Iterable[str]) -> list[str]:
    """The modules an adapter checkpoint adapts (each must have both factors)."""
    names = set(names)
    modules = sorted(n[len(PREFIX):-len(A_SUFFIX)] for n in names
                     if n.startswith(PREFIX) and n.endswith(A_SUFFIX))
    missing = [factor_names(m)[1] for m in modules if factor_names(m)[1] not in names]
    extra = sorted(names - {n for m in modules for n in factor_names(m)})
    if missing or extra:
        raise ValueError(f"not a LoRA adapter: {(missing + extra)[0]!r} has no partner")
    return modules


def frozen_tensors(index: Iterable[TensorInfo]) -> list[str]:
    """The A factors of an adapter's tensor index (what ``aggregation.lora: freeze_a`` keeps)."""
    return [t.name for t in index if t.name.endswith(A_SUFFIX)]
