"""The JobSpec schema: what a user writes in job.yaml."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xffl.training.config import DataSpec, ModelSpec, TrainingSpec

NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
NAME_RULE = "lower-case letters, digits, '-' or '_', starting with a letter, at most 32 characters"


def check_name(value: str) -> str:
    """Names end up in CWL ids, SLURM job names, paths and shell lines: keep them plain."""
    if not NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a valid name; use {NAME_RULE}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AggregationSpec(_Strict):
    """How the coordinator combines the site updates every round.

    ``params`` override the strategy's defaults (xffl.aggregator.strategies.DEFAULT_PARAMS),
    e.g. ``{eta: 0.01}`` for fedadam.
    """

    strategy: Literal[
        "fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "fedtrimmedavg"
    ] = "fedavg"
    weighting: Literal["samples", "tokens", "uniform"] = "samples"
    params: dict[str, float] = Field(default_factory=dict)
    max_shard_size: str | int | None = Field(
        default=None,
        description="largest global model file, e.g. 5GB, 500MB or 2GiB: a bigger model is "
        "split into Hugging Face shards with model.safetensors.index.json; 0 never splits; "
        "default 5GB (Hugging Face's)",
    )

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str | int | None) -> str | int | None:
        from xffl.aggregator.shards import parse_size
        from xffl.core.errors import InvalidInput

        try:
            parse_size(value)
        except InvalidInput as exc:
            raise ValueError(exc.message.rstrip(".")) from None
        return value

    @model_validator(mode="after")
    def _known_params(self) -> AggregationSpec:
        from xffl.aggregator.strategies import DEFAULT_PARAMS

        known = DEFAULT_PARAMS[self.strategy]
        for key in self.params:
            if key not in known:
                allowed = ", ".join(known) or "none"
                raise ValueError(
                    f"{self.strategy} has no parameter {key!r} (its parameters: {allowed})"
                )
        return self


class SiteSpec(_Strict):
    """One facility taking part in the job."""

    name: str
    profile: str
    ranks: int = Field(default=1, ge=1, le=4096, description="training processes at the site")
    data: DataSpec

    _name = field_validator("name")(check_name)


class JobSpec(_Strict):
    """A federated training job: model, local training, aggregation, rounds, sites."""

    name: str
    rounds: int = Field(ge=1, le=100_000)
    model: ModelSpec = Field(default_factory=ModelSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec)
    sites: list[SiteSpec] = Field(min_length=1)

    _name = field_validator("name")(check_name)

    @model_validator(mode="after")
    def _unique_sites(self) -> JobSpec:
        seen: set[str] = set()
        for site in self.sites:
            if site.name in seen:
                raise ValueError(
                    f"site name {site.name!r} appears twice; give each site its own name"
                )
            seen.add(site.name)
        return self
