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
from typing import Any

from xffl.aggregator.exchange import Manifest
from xffl.aggregator.metrics import (
    GROUP_BYTES_PER_STEP,
    GROUP_BYTES_ROUND,
    GROUP_METRICS,
    HARDWARE_METRICS,
    KNOWN_METRICS,
    MFU,
    PEAK_MEMORY_GIB,
    SAVE_SECONDS,
    TFLOPS,
    TOKENS_PER_S_PER_GPU,
    VAL_SAMPLES,
    VAL_TOKENS,
    VALIDATION_LOSSES,
    VALIDATION_METRICS,
)
from xffl.core.errors import CheckpointError
from xffl.core.words import quoted

# a validation loss (nats per target) above this x ln(vocabulary), the loss of a uniform guess
# over the model's vocabulary, is refused: no model the run trains is this far off, and
# one site's number cannot then dominate the federated validation loss
VAL_LOSS_FACTOR = 3.0
MAX_METRIC = 1e12  # no loss, rate or count of a round is near this; NaN and Inf never pass
# no count of a round is near this, whatever the job (2**53: floats hold every smaller integer)
MAX_COUNT = 2**53
# the hardware a site names in its manifest's extra: a device's name is a short line of
# printable text (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3"), its GPUs a count
MAX_DEVICE_NAME = 128
MAX_GPUS = 1 << 20
MAX_MFU = 1.0  # achieved model FLOP/s over the device's peak: never above it


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
    # the model's vocabulary (the global's config.json ``vocab_size``, the coordinator's):
    # a validation loss is at most VAL_LOSS_FACTOR x ln(vocab_size); None: only MAX_METRIC
    vocab_size: int | None = None


def check_reported(manifest: Manifest, bounds: Bounds) -> None:
    """Counts and metrics are finite numbers within what the site could have done."""
    unknown = sorted(set(manifest.metrics) - KNOWN_METRICS)
    if unknown:
        raise CheckpointError(f"it reports {len(unknown)} metric(s) xffl does not know "
                              f"(first: {quoted(unknown[0])})")
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
    check_validation(manifest.metrics, bounds.max_val_samples, bounds.val_seq_len,
                     bounds.vocab_size)
    check_hardware(manifest)



def max_val_loss(vocab_size: int) -> float:
    """The largest validation loss admitted: VAL_LOSS_FACTOR x the loss of a uniform guess
    over ``vocab_size`` tokens (ln of it)."""
    return VAL_LOSS_FACTOR * math.log(max(vocab_size, 2))


def check_validation(metrics: Mapping[str, float], max_val_samples: int | None,
                     seq_len: int | None = None, vocab_size: int | None = None) -> None:
    """Validation numbers are all there or none, losses are not negative, the sequences they
    were measured on are a whole number within the job's evaluation budget, and their
    targets in the loss (``val_tokens``, the site's weight in the federated validation loss)
    a whole number no larger than those sequences hold (``seq_len`` each): a site cannot
    outweigh the others by claiming more of either; with ``vocab_size``, a loss is at most
    :func:`max_val_loss` (a site cannot dominate the mean with 1e12)."""
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
        if vocab_size is not None and metrics[name] > max_val_loss(vocab_size):
            raise CheckpointError(
                f"metric {name!r} is {metrics[name]!r}, more than {VAL_LOSS_FACTOR:g} x "
                f"ln({vocab_size}) = {max_val_loss(vocab_size):.4f}, {VAL_LOSS_FACTOR:g} times "
                "the loss of a uniform guess over the model's vocabulary")
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


def check_hardware(manifest: Manifest) -> None:
    """The hardware numbers are not negative, MFU is at most 1, and the ``device`` and
    ``gpus`` of the manifest's ``extra`` (when given) are a short printable name and a count:
    they are shown in `xffl status` and the report, and recorded in the registry."""
    for name in (*HARDWARE_METRICS, *GROUP_METRICS):
        value = manifest.metrics.get(name)
        if value is not None and value < 0:
            raise CheckpointError(f"metric {name!r} is {value!r}; it is never negative")
    mfu = manifest.metrics.get(MFU)
    if mfu is not None and mfu > MAX_MFU:
        raise CheckpointError(f"metric {MFU!r} is {mfu!r}; a device never runs faster than "
                              f"its peak (at most {MAX_MFU:g})")
    device = manifest.extra.get("device")
    if device is not None and (not isinstance(device, str) or not device
                               or len(device) > MAX_DEVICE_NAME or not device.isprintable()):
        shown = repr(device)[:64] + ("..." if len(repr(device)) > 64 else "")
        raise CheckpointError(f"its device {shown} is not a name of 1 to {MAX_DEVICE_NAME} "
                              "printable characters")
    gpus = manifest.extra.get("gpus")
    if gpus is not None and (type(gpus) is not int or not 0 <= gpus <= MAX_GPUS):
        shown = repr(gpus)[:64]
        raise CheckpointError(f"its gpus {shown} is not a whole number from 0 to {MAX_GPUS}")


def hardware_of(manifest: Manifest) -> dict[str, Any]:
    """The hardware a checked manifest reports (:func:`check_hardware`), under the names of
    the registry's site rounds; None for what it does not report."""
    device, gpus = manifest.extra.get("device"), manifest.extra.get("gpus")
    return {"device": device if isinstance(device, str) else None,
            "gpus": gpus if type(gpus) is int else None,
            **{name: manifest.metrics.get(name) for name in (
                TOKENS_PER_S_PER_GPU, TFLOPS, MFU, PEAK_MEMORY_GIB)},
            "save_seconds": manifest.metrics.get(SAVE_SECONDS),
            "group_bytes_per_step": manifest.metrics.get(GROUP_BYTES_PER_STEP),
            "group_bytes_round": manifest.metrics.get(GROUP_BYTES_ROUND)}
