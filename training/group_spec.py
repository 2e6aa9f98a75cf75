"""The ``training.local_groups`` section: federated groups of ranks inside one site.

The site's ranks form ``groups`` groups of consecutive ranks; each group trains on its own
share of every step's batch with the site's data parallelism (DDP, FSDP2, HSDP) and tensor
parallelism inside it, and the groups average their weights every ``every`` optimizer steps
and at the end of the round (:mod:`xffl.training.local_groups`). No torch here: the CLI
validates job specs with it.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from xffl.core.validation import StrictModel


class LocalGroupsSpec(StrictModel):
    """Groups of a site's ranks that train independently and average every ``every`` steps.

    ``outer: average`` sets every group to the groups' mean (local SGD; ``average_moments``
    also averages AdamW's two moments); ``outer: nesterov`` is DiLoCo's outer step: the
    outer gradient is the weights at the last sync minus the groups' mean, applied by SGD
    with Nesterov momentum (``outer_lr``, ``outer_momentum``), each group keeping its own
    AdamW state. The site's update at the end of the round is the result of a last sync.
    """

    groups: int = Field(description="groups of consecutive ranks (>= 2; divides every "
                        "site's ranks)")
    every: int = Field(description="optimizer steps between the groups' averages (>= 1)")
    average_moments: bool = Field(default=False, description="outer average: also average "
                                  "AdamW's moments (exp_avg, exp_avg_sq) at every sync")
    outer: Literal["average", "nesterov"] = Field(
        default="average", description="average: the groups' mean (local SGD); nesterov: "
        "DiLoCo's outer SGD step with Nesterov momentum on (last sync - mean)")
    outer_lr: float = Field(default=0.7, description="nesterov: the outer learning rate "
                            "(DiLoCo: 0.7)")
    outer_momentum: float = Field(default=0.9, description="nesterov: the outer momentum "
                                  "(DiLoCo: 0.9), 0 <= m < 1")
    keep: bool = Field(default=False, description="write each group's model before the "
                       "round's last sync into the site's state folder (groups/r<round>/"
                       "group-<g>.safetensors; the launcher's --keep), to audit the average")

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"groups is {value}; one group is plain data parallelism: give 2 "
                             "or more groups, or remove training.local_groups")
        return value

    @field_validator("every")
    @classmethod
    def _every(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"every is {value}; the groups average every k optimizer steps: "
                             "write a whole number k >= 1")
        return value

    @model_validator(mode="after")
    def _outer(self) -> LocalGroupsSpec:
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr is {self.outer_lr}; write a positive number "
                             "(DiLoCo uses 0.7)")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum is {self.outer_momentum}; write a number from 0 "
                             "up to (not including) 1 (DiLoCo uses 0.9)")
        if self.average_moments and self.outer == "nesterov":
            raise ValueError("average_moments applies to outer: average only (DiLoCo keeps "
                             "each group's own AdamW state); remove one of them")
        return self

    def ranks_per_group(self, ranks: int) -> int | None:
        """Ranks of one group at a site of ``ranks`` (None: ``groups`` does not divide them)."""
        return ranks // self.groups if ranks >= self.groups and ranks % self.groups == 0 \
            else None
