"""What a site reports beside its tensors: counts and metrics, within what its job allows.

A site's manifest claims how many samples and tokens it trained on (its weight in the
average), its losses and timings, and what it measured on its held-out data. None of it is
trusted: each metric must be one xffl's training reports (:data:`KNOWN_METRICS`) and a finite
number, and the counts must lie within what the coordinator knows the site's job could have
done (:class:`Bounds`), and in any case below MAX_COUNT, before any arithmetic is done on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from xffl.aggregator.exchange import Manifest
from xffl.aggregator.metrics import (
    KNOWN_METRICS,
    SAVE_SECONDS,
    VAL_SAMPLES,
    VAL_TOKENS,
    VALIDATION_LOSSES,
    VALIDATION_METRICS,
)
from xffl.core.errors import CheckpointError

MAX_METRIC = 1e12  # no loss, rate or count of a round is near this; NaN and Inf never pass
# no count of a round is near this, whatever the job (2**53: floats hold every smaller integer)
MAX_COUNT = 2**53


@dataclass(frozen=True)
class Bounds:
    """What the coordinator knows a site could have done in one round.

    ``max_tokens``: steps x batch x accumulation x sequence length x ranks of the site's job
    (balancing and token budgets included); ``max_samples``: the size of its dataset when
    the job declares it, else the samples those steps read (steps x batch x accumulation x
    ranks). ``None``: no bound of the job's, only MAX_COUNT. ``side_files``: files that may
    come back beside the checkpoint without being part of it (``slurm_job.json``), with
    their size caps.
    """

    max_tokens: int | None = None
    max_samples: int | None = None
    side_files: Mapping[str, int] = field(default_factory=dict)
    # held-out sequences the site's evaluation reads at most (its job's evaluation budget);
    # None: the job gives the site no validation data, so it reports no validation numbers
    max_val_samples: int | None = None
    # targets one held-out sequence holds (the job's training.seq_len): val_tokens is at most
    # val_samples x this, so at most max_val_samples x seq_len; None: no bound but MAX_COUNT
    val_seq_len: int | None = None


def check_reported(manifest: Manifest, bounds: Bounds) -> None:
    """Counts and metrics are finite numbers within what the site could have done."""
    unknown = sorted(set(manifest.metrics) - KNOWN_METRICS)
    if unknown:
        shown = unknown[0] if len(unknown[0]) <= 64 else unknown[0][:64] + "..."
        raise CheckpointError(f"it reports {len(unknown)} metric(s) xffl does not know "
                              f"(first: {shown!r})")
    for name, value in sorted(manifest.metrics.items()):
        if not math.isfinite(value) or abs(value) > MAX_METRIC:
            raise CheckpointError(f"metric {name!r} is {value!r}, not a finite number below "
                                  f"{MAX_METRIC:g}")
    if manifest.metrics.get(SAVE_SECONDS, 0.0) < 0:
        raise CheckpointError(f"metric {SAVE_SECONDS!r} is {manifest.metrics[SAVE_SECONDS]!r}; "
                              "a duration is never negative")
    for what, value, cap in (("num_tokens", manifest.num_tokens, bounds.max_tokens),
                             ("num_samples", manifest.num_samples, bounds.max_samples)):
        limit = MAX_COUNT if cap is None else min(cap, MAX_COUNT)
        if value > limit:
            shown = str(value) if value < 10**30 else f"a {len(str(value))}-digit number"
            raise CheckpointError(f"{what} is {shown}, more than the {limit} the site's job "
                                  "allows")
    check_validation(manifest.metrics, bounds.max_val_samples, bounds.val_seq_len)



def check_validation(metrics: Mapping[str, float], max_val_samples: int | None,
                     seq_len: int | None = None) -> None:
    """Validation numbers are all there or none, losses are not negative, the sequences they
    were measured on are a whole number within the job's evaluation budget, and their
    targets in the loss (``val_tokens``, the site's weight in the federated validation loss)
    a whole number no larger than those sequences hold (``seq_len`` each): a site cannot
    outweigh the others by claiming more of either."""
    given = [name for name in VALIDATION_METRICS if name in metrics]
    if not given:
        return
    if max_val_samples is None:
        raise CheckpointError("it reports validation numbers, but the job gives the site no "
                              "data.validation")
    if len(given) != len(VALIDATION_METRICS):
        missing = [name for name in VALIDATION_METRICS if name not in metrics]
        raise CheckpointError(f"it reports {given[0]!r} without {missing[0]!r}")
    for name in VALIDATION_LOSSES:
        if metrics[name] < 0:
            raise CheckpointError(f"metric {name!r} is {metrics[name]!r}; a cross-entropy "
                                  "is never negative")
    samples = metrics[VAL_SAMPLES]
    if samples != int(samples) or not 1 <= samples <= max_val_samples:
        shown = int(samples) if samples == int(samples) else samples
        raise CheckpointError(f"{VAL_SAMPLES} is {shown!r}, not a whole number from 1 to the "
                              f"{max_val_samples} its job's evaluation budget allows")
    tokens = metrics[VAL_TOKENS]
    most = MAX_COUNT if seq_len is None else int(samples) * seq_len
    if tokens != int(tokens) or not 0 <= tokens <= most:
        shown = int(tokens) if tokens == int(tokens) else tokens
        held = "" if seq_len is None else (f" its {int(samples)} held-out sequences of "
                                           f"{seq_len} targets hold")
        raise CheckpointError(f"{VAL_TOKENS} is {shown!r}, not a whole number from 0 to the "
                              f"{most}{held}")
