"""The job spec's ``round_deadline`` section: local steps sized so each update is expected by it."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

STALENESS_FUNCTIONS = ("constant", "polynomial", "exponential")


class StalenessSpec(BaseModel):
    """How much an update that arrives ``tau`` rounds late weighs (FedAsync's functions).

    constant: 1; polynomial: ``(1 + tau) ** -a``; exponential: ``exp(-a tau)``. An update later
    than ``max_rounds`` is not admitted.
    """

    model_config = ConfigDict(extra="forbid")

    function: Literal["constant", "polynomial", "exponential"] = Field(
        default="polynomial", description="constant, polynomial or exponential in the rounds "
        "an update is late")
    a: float = Field(default=0.5, ge=0, le=100, description="the decay: (1 + tau)^-a or "
                     "exp(-a tau)")
    max_rounds: int = Field(default=4, ge=1, le=1000, description="rounds late beyond which an "
                            "update is dropped")

    def weight(self, tau: int) -> float:
        """The weight factor of an update ``tau`` >= 0 rounds late (1 when on time)."""
        if tau < 0:
            raise ValueError(f"staleness must be at least 0, got {tau}")
        if self.function == "constant":
            return 1.0
        if self.function == "polynomial":
            return float((1 + tau) ** -self.a)
        return math.exp(-self.a * tau)


class RoundDeadline(BaseModel):
    """A round deadline: each site trains as many steps as fit before it.

    A site's steps for a round are ``floor((seconds - queue - startup) / seconds_per_step)``
    from its estimates (:mod:`xffl.jobs.report.estimates`), within ``[min_steps, max_steps]``; a site
    not measured yet trains its configured steps (within the same bounds).
    """

    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(gt=0, le=30 * 86400, description="seconds from a round's start by "
                           "which each site's update is expected: queue wait + start-up + "
                           "steps x seconds per step")
    min_steps: int = Field(default=1, ge=1, le=10_000_000, description="fewest local steps a "
                           "site trains, however late that makes it")
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000, description="most local "
                                  "steps (default: the site's configured steps x "
                                  "training.balance_max)")
    startup: float = Field(default=60.0, ge=0, description="seconds from a site's job start to "
                           "its first step, before one is measured (a site's own: "
                           "sites[].startup)")
    staleness: StalenessSpec = Field(default_factory=StalenessSpec,
                                     description="the weight of an update that arrives late")
    late: Literal["wait", "adopt"] = Field(
        default="wait", description="a site not in at the deadline: wait (the round waits "
        "for it, or failure.round_timeout cancels it) or adopt (the round goes on without it, "
        "its SLURM job is left to finish and a later round admits its update, weighted by "
        "staleness)")

    @field_validator("max_steps")
    @classmethod
    def _bounds(cls, value: int | None, info: ValidationInfo) -> int | None:
        low = info.data.get("min_steps")
        if value is not None and low is not None and low > value:
            raise ValueError(f"max_steps {value} is below min_steps {low}; make max_steps at "
                             f"least {low}, or lower min_steps")
        return value
