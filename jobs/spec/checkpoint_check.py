"""``xffl validate``'s checks of ``training.checkpoint`` (checkpoints inside a round) against
what one checkpoint costs: an interval in minutes shorter than a checkpoint takes to write, or
a site's SLURM time limit shorter than one checkpoint (with ``chain``: plus the margin a
chained round's job saves in before its limit), is refused with its file:line.

The cost is an estimate, declared here, not a measurement of the site: a checkpoint holds
the fp32 weights and AdamW's two fp32 moments, :data:`BYTES_PER_PARAMETER` bytes a parameter
(whatever the dtype a site trains in; a LoRA job's frozen base is counted as trained, an
upper bound), written at :data:`WRITE_GBPS` GB/s after :data:`FIXED_SECONDS` s. The rate is
the fastest ``bench/round_checkpoint`` measured (a 349 M-parameter model at Llama-3.1-8B
width, 4.7 GB, FSDP2 over 2 gloo ranks on a shared two-core CPU box: ``dcp.save`` 0.40 GB/s,
an async save until its ``complete`` marker 0.11 GB/s, sha256 included), so that only an
interval or time limit shorter than the fastest write seen is refused; a Lustre or NVMe
site may write faster, and one that writes slower is not refused.
"""

from __future__ import annotations

import math
from pathlib import Path

from xffl.core.validation import field_path
from xffl.core.yamlio import Loc, YamlDoc
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.schema import SiteProfile, slurm_time_seconds
from xffl.training.round_spec import (
    BYTES_PER_PARAMETER,
    WRITE_GBPS,
    chain_margin,
    checkpoint_seconds,
)


def _parameters(spec: JobSpec) -> int | None:
    """The model's parameters from its config (None when the model is wrong: reported
    elsewhere)."""
    from xffl.training.arch import build_config
    from xffl.training.memory_model import model_parts

    try:
        return int(model_parts(build_config(spec.model)).total)
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def signal_margin(spec: JobSpec) -> int | None:
    """The seconds before a site's time limit at which SLURM signals a chained round's job
    (``--signal=B:USR1@...``), from the declared cost of one checkpoint (None: no chain)."""
    ckpt = spec.training.checkpoint
    if ckpt is None or not ckpt.chain:
        return None
    return chain_margin(checkpoint_seconds(_parameters(spec) or 0))


def check_round_checkpoints(doc: YamlDoc, spec: JobSpec, path: Path,
                            profiles: dict[str, SiteProfile]) -> list[str]:
    """One line per problem of ``training.checkpoint`` (none when it is not set)."""
    ckpt = spec.training.checkpoint
    if ckpt is None:
        return []
    params = _parameters(spec)
    if params is None:
        return []
    cost = checkpoint_seconds(params)
    what = (f"one checkpoint of this model ({params / 1e9:.2f} B parameters, "
            f"{BYTES_PER_PARAMETER * params / 1e9:.1f} GB) takes about {cost:.0f} s "
            f"(xffl's estimate: {WRITE_GBPS} GB/s)")
    errors = []
    seconds = ckpt.every_seconds
    if seconds is not None and seconds < cost:
        errors.append(f"{_at(doc, path, ('training', 'checkpoint', 'every'))}: every "
                      f"{ckpt.every} is shorter than a checkpoint: {what}; write at least "
                      f"\"{int(cost // 60) + 1}m\" or a number of steps.")
    for i, site in enumerate(spec.sites):
        profile = profiles.get(site.name)
        if profile is None:
            continue
        try:
            slurm = profile.with_slurm(site.slurm).slurm
            limit = slurm_time_seconds(slurm.time) if slurm is not None and slurm.time \
                else None
        except ValueError:
            continue  # reported by the profile's own checks
        # a chained round's job also keeps the margin before its limit (chain_margin)
        need = cost + (chain_margin(cost) if ckpt.chain else 0)
        if limit is None or limit >= need:
            continue
        loc: Loc = ("sites", i, "slurm", "time") if site.slurm is not None and \
            site.slurm.time is not None else ("sites", i, "profile")
        errors.append(f"{_at(doc, path, loc)}: site {site.name!r}'s SLURM time limit "
                      f"{slurm.time if slurm is not None else ''} ({limit} s) is shorter than "
                      + (f"one checkpoint plus the {chain_margin(cost)} s margin a chained "
                         f"round saves in (training.checkpoint.chain): {what}; give the site "
                         f"at least {math.ceil(need)} s or remove training.checkpoint.chain."
                         if ckpt.chain else
                         f"one checkpoint: {what}; give the site a longer time limit or "
                         "remove training.checkpoint."))
    return errors


def _at(doc: YamlDoc, path: Path, loc: Loc) -> str:
    """``FILE:LINE: job spec field FIELD`` for ``loc``."""
    line = doc.line_of(loc)
    return f"{path}:{line}: job spec field {field_path(loc)}" if line else (
        f"{path}: job spec field {field_path(loc)}")
