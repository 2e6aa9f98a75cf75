"""`xffl validate`'s checks of a job against each facility's GPUs: memory, ranks per node, tp.

Per site, the peak memory per rank the memory model (:mod:`xffl.training.memory_model`)
estimates for the site's layout is compared with the GPU memory its profile declares
(``gpu_memory_gib``): a job fits when the estimate is at most 90 % of it. A site without
that field (a CPU machine, the ``local`` profile) gets the fp32 CPU estimate, for information,
and no check. Ranks per node must not exceed the node's GPUs (two ranks on one GPU stop
NCCL), and a tensor-parallel group should stay on one node; an HSDP shard group that spans
nodes is named (allowed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from xffl.training.memory_model import (
    FIT_SHARE,
    GIB,
    Estimate,
    ModelParts,
    estimate,
    model_parts,
    site_layout,
)

if TYPE_CHECKING:
    from xffl.jobs.spec.load import LoadedJob
    from xffl.site_profiles.schema import SiteProfile
    from xffl.training.config import TrainingSpec

#: the most ranks a fix may propose (FSDP2 shards the 16 B per parameter over them)
MAX_RANKS = 4096


@dataclass(frozen=True)
class SiteFit:
    """One site's row: its layout, the estimated peak per rank and the GPU it must fit."""

    site: str
    profile: str
    ranks: int
    layout: str
    estimate_gib: float | None  # None: a model.entry_point model (no config to count)
    phase: str | None
    gpus_per_node: int | None
    gpu_memory_gib: float | None  # None: no GPU check (a CPU site)
    fits: bool | None
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as JSON (GiB rounded to 1 MiB)."""
        out = asdict(self)
        if self.estimate_gib is not None:
            out["estimate_gib"] = round(self.estimate_gib, 3)
        return out


@dataclass(frozen=True)
class SiteChecks:
    """Every site's row, the refusals (one sentence each) and the warnings."""

    rows: list[SiteFit]
    errors: list[str]
    warnings: list[str]


def _fits(est: Estimate, gib: float) -> bool:
    return est.peak <= FIT_SHARE * gib * GIB


def _estimate(parts: ModelParts, spec: TrainingSpec, ranks: int, gpu: bool,
              gib: float | None) -> Estimate:
    return estimate(parts, site_layout(spec, ranks, parts, gpu=gpu,
                                       gpu_memory=_bytes(gib)))


def _bytes(gib: float | None) -> int | None:
    """One GPU's bytes (None: not declared)."""
    return None if gib is None else int(gib * GIB)


def find_fix(parts: ModelParts, spec: TrainingSpec, ranks: int, gib: float) -> str:
    """The changes, tried in turn and kept, that bring the estimate under 90 % of ``gib``."""
    done: list[str] = []
    layout = site_layout(spec, ranks, parts, gpu_memory=_bytes(gib))
    steps: list[tuple[str, dict[str, Any]]] = []
    if layout.mode == "ddp":
        steps.append(("data_parallel: fsdp", {"data_parallel": "fsdp"}))
    if layout.ac_every != 1:
        steps.append(("activation_checkpointing: true", {"activation_checkpointing": True}))
    for text, update in steps:
        spec = spec.model_copy(update=update)
        done.append(text)
        est = _estimate(parts, spec, ranks, True, gib)
        if _fits(est, gib):
            return f"{', '.join(done)} (estimated {est.gib:.1f} GiB)"
    tokens = spec.batch_size * spec.grad_accum
    for batch in range(spec.batch_size - 1, 0, -1):
        trial = spec.model_copy(update={"batch_size": batch,
                                        "grad_accum": max(1, tokens // batch)})
        est = _estimate(parts, trial, ranks, True, gib)
        if _fits(est, gib):
            done.append(f"batch_size: {batch}, grad_accum: {trial.grad_accum} (the same "
                        "sequences per step)")
            return f"{', '.join(done)} (estimated {est.gib:.1f} GiB)"
    tp = spec.tensor_parallel
    fsdp = spec.model_copy(update={"data_parallel": "fsdp", "batch_size": 1,
                                   "grad_accum": max(1, tokens)})
    for more in range(ranks + tp, MAX_RANKS + 1, tp):
        est = _estimate(parts, fsdp, more, True, gib)
        if _fits(est, gib):
            return (f"{', '.join([*done, 'batch_size: 1'])} and ranks: {more} (FSDP2 shards "
                    f"the weights and optimizer over more GPUs; estimated {est.gib:.1f} GiB)")
    return "a GPU with more memory (no layout up to 4096 ranks fits)"


def _shard_group_note(where: str, site: str, ranks: int, shard: int | None,
                      profile: SiteProfile, tp: int = 1) -> list[str]:
    """HSDP: a shard group (shard_group x tensor_parallel consecutive ranks) that spans nodes
    is allowed, but its collectives cross the network."""
    slurm = profile.slurm
    if shard is None or slurm is None or slurm.nodes <= 1 or ranks % slurm.nodes:
        return []
    group = shard * tp
    per_node = ranks // slurm.nodes
    if per_node % group == 0:
        return []
    return [f"{where}: site {site!r}: a shard group of {group} ranks spans "
            f"{math.ceil(group / per_node) if group > per_node else 2} of its {slurm.nodes} "
            f"nodes ({per_node} ranks a node), so its all-gathers and reduce-scatters cross "
            f"the network every step (allowed); a shard_group dividing {per_node // tp or 1} "
            "keeps them inside a node."]


def _node_checks(where: str, site: str, ranks: int, tp: int,
                 profile: SiteProfile) -> tuple[list[str], list[str]]:
    """Ranks per node against the node's GPUs; a tensor-parallel group inside one node."""
    slurm = profile.slurm
    if slurm is None or not slurm.gpus_per_node:
        return [], []
    gpus, nodes = slurm.gpus_per_node, slurm.nodes
    per_node = math.ceil(ranks / nodes)
    errors, warnings = [], []
    if per_node > gpus:
        errors.append(
            f"{where}: site {site!r} runs {ranks} ranks on {nodes} node(s), {per_node} a node, "
            f"but a node has {gpus} GPUs, so two ranks would share a GPU (NCCL refuses); use "
            f"ranks: {nodes * gpus} or slurm nodes: {math.ceil(ranks / gpus)}.")
    if tp > 1 and (gpus % tp or per_node % tp):
        warnings.append(
            f"{where}: site {site!r}: tensor_parallel {tp} does not divide the {gpus} GPUs "
            f"({per_node} ranks) of a node, so a tensor-parallel group spans nodes and its "
            "all-reduces cross the network; use a tensor_parallel that divides "
            f"{gpus} (or 1 with data_parallel: fsdp).")
    return errors, warnings


def check_sites(loaded: LoadedJob) -> SiteChecks:
    """The memory and placement checks of every site of ``loaded`` (nothing raised here)."""
    from xffl.training.arch import build_config

    spec = loaded.spec
    training = spec.training
    parts = None
    if spec.model.entry_point is None:
        parts = model_parts(build_config(spec.model), training.lora)
    rows, errors, warnings = [], [], []
    for i, site in enumerate(spec.sites):
        where = f"{loaded.path}: job spec field sites[{i}]"
        profile = loaded.site_profile(site.name)
        gib = profile.gpu_memory_gib
        node_errors, node_warnings = _node_checks(where, site.name, site.ranks,
                                                  training.tensor_parallel, profile)
        errors.extend(node_errors)
        warnings.extend(node_warnings)
        warnings.extend(_shard_group_note(where, site.name, site.ranks, training.shard_group,
                                          profile, training.tensor_parallel))
        gpus = profile.slurm.gpus_per_node if profile.slurm is not None else None
        gpu = gib is not None or bool(gpus)
        est = _estimate(parts, training, site.ranks, gpu, gib) if parts else None
        layout = site_layout(training, site.ranks, parts, gpu_memory=_bytes(gib)) \
            if parts else None
        shape = (f"hsdp {layout.dp // training.shard_group} x {training.shard_group}"
                 + (f" x tp {layout.tp}" if layout.tp > 1 else "")
                 if layout and training.shard_group and layout.shard else
                 f"{layout.mode} dp {layout.dp} x tp {layout.tp}" if layout else
                 f"tp {training.tensor_parallel}")
        if training.local_groups is not None:  # the layout of each group (site_layout's)
            shape = f"{training.local_groups.groups} groups of {shape}"
        fits = None if gib is None or est is None else _fits(est, gib)
        fix = None
        if fits is False and parts is not None and est is not None and gib is not None:
            fix = find_fix(parts, training, site.ranks, gib)
            errors.append(
                f"{where}: site {site.name!r} ({profile.name}) needs about {est.gib:.1f} GiB "
                f"per GPU ({layout.mode if layout else ''}, peak in the {est.phase}), more "
                f"than 90 % of its {gib:g} GiB cards; use {fix}.")
        rows.append(SiteFit(site=site.name, profile=profile.name, ranks=site.ranks,
                            layout=shape, estimate_gib=est.gib if est else None,
                            phase=est.phase if est else None, gpus_per_node=gpus,
                            gpu_memory_gib=gib, fits=fits, fix=fix))
    return SiteChecks(rows=rows, errors=errors, warnings=warnings)
