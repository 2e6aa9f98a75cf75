"""``xffl validate``'s checks of ``training.local_groups`` against every site's ranks and the
rest of the training section: one line per problem, with its file:line."""

from __future__ import annotations

from pathlib import Path

from xffl.core.validation import field_path
from xffl.core.yamlio import Loc, YamlDoc
from xffl.jobs.spec.schema import JobSpec

GROUPS = ("training", "local_groups", "groups")


def _at(doc: YamlDoc, path: Path, loc: Loc) -> str:
    """``FILE:LINE: job spec field FIELD`` for ``loc``."""
    line = doc.line_of(loc)
    return f"{path}:{line}: job spec field {field_path(loc)}" if line else (
        f"{path}: job spec field {field_path(loc)}")


def _combinations(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """What local groups do not combine with: round checkpoints, LoRA, update_fn."""
    training = spec.training
    refused = [("checkpoint", training.checkpoint is not None, "a round checkpoint holds one "
                "model, not each group's"),
               ("lora", training.lora is not None, "the groups average whole models"),
               ("update_fn", training.update_fn is not None, "a streamed update runs no "
                "optimizer steps to group")]
    return [f"{_at(doc, path, ('training', name))}: training.{name} does not combine with "
            f"training.local_groups ({why}); remove one of them."
            for name, present, why in refused if present]


def check_local_groups(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """Every site's ranks split into ``groups`` groups, each able to run the site's data and
    tensor parallelism (HSDP's shard_group and tensor_parallel divide a group's ranks)."""
    groups = spec.training.local_groups
    if groups is None:
        return []
    errors = _combinations(doc, spec, path)
    training = spec.training
    for site in spec.sites:
        per = groups.ranks_per_group(site.ranks)
        if per is None:
            more = "is more than" if groups.groups > site.ranks else "does not divide"
            errors.append(f"{_at(doc, path, GROUPS)}: groups {groups.groups} {more} the "
                          f"{site.ranks} ranks of site {site.name!r}; use a divisor of "
                          f"{site.ranks} (2 or more), or give the site more ranks.")
            continue
        if training.data_parallel == "hsdp" and per < 2:
            errors.append(f"{_at(doc, path, GROUPS)}: groups {groups.groups} leave 1 rank per "
                          f"group at site {site.name!r}, and data_parallel hsdp inside a group "
                          "needs 2 or more; use fewer groups or data_parallel: auto.")
        elif training.data_parallel == "hsdp" and training.shard_group is not None and \
                per % training.shard_group:
            errors.append(f"{_at(doc, path, ('training', 'shard_group'))}: shard_group "
                          f"{training.shard_group} does not divide a local group's {per} ranks "
                          f"at site {site.name!r}; use a divisor of {per}.")
        if training.data_parallel == "hsdp" and training.tensor_parallel > 1:
            errors.append(f"{_at(doc, path, ('training', 'tensor_parallel'))}: HSDP with "
                          "tensor_parallel inside local groups is not supported; use "
                          "data_parallel: fsdp inside the groups, or tensor_parallel: 1.")
        elif per % training.tensor_parallel:
            errors.append(f"{_at(doc, path, ('training', 'tensor_parallel'))}: tensor_parallel "
                          f"{training.tensor_parallel} does not divide a local group's {per} "
                          f"ranks at site {site.name!r}; use a divisor of {per} or fewer "
                          "groups.")
    return errors
