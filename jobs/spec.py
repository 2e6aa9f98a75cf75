"""The JobSpec schema: what a user writes in job.yaml."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from xffl.aggregator import registry
from xffl.core.layout import RunLayout
from xffl.core.names import check_name
from xffl.core.sizes import DEFAULT_MAX_SHARD_SIZE
from xffl.jobs.spec.deadline import RoundDeadline
from xffl.jobs.spec.tracking import TrackingSpec
from xffl.site_profiles.schema import SlurmOverride
from xffl.training.config import (
    DataSpec,
    EvaluationSpec,
    ModelSpec,
    TrainingSpec,
)
from xffl.aggregator.exchange_spec import ExchangeSpec

_ROUND_SUFFIX = re.compile(r"-r[0-9]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AggregationSpec(_Strict):
    """How the coordinator combines the site updates every round.

    ``strategy`` is a name of :mod:`xffl.aggregator.strategy_catalog`; ``params`` override its
    defaults, e.g. ``{eta: 0.01}`` for fedadam.
    """

    strategy: str = Field(default="fedavg", description="a registered strategy (`xffl "
                          "aggregate --help` lists them)")
    weighting: Literal["samples", "tokens", "uniform"] = Field(
        default="samples", description="what each site's update weighs in the average")
    params: dict[str, float] = Field(default_factory=dict,
                                     description="the strategy's parameters, e.g. {eta: 0.01}")
    max_shard_size: str | int = Field(
        default=DEFAULT_MAX_SHARD_SIZE,
        description="largest global model file, e.g. 5GB, 500MB or 2GiB: a bigger model is "
        "split into Hugging Face shards with model.safetensors.index.json; 0 never splits; "
        "default 5GB (Hugging Face's)",
    )

    clip_norm: float | None = Field(
        default=None, gt=0, description="scale each update's change from the round's global "
        "to at most this L2 norm (averaging strategies): one site moves the mean by at most "
        "clip_norm x its share")
    max_weight_share: float | None = Field(
        default=None, gt=0, le=1, description="no site's share of the weights above this "
        "(averaging strategies): a site cannot own the mean by reporting a huge dataset")
    lora: Literal["separate", "freeze_a"] | None = Field(
        default=None, description="with training.lora: separate (each of A and B aggregated "
        "on its own, the default) or freeze_a (A stays at its seeded value everywhere, only B "
        "is trained and aggregated, so the aggregate of the products B·A is exact)")

    @field_validator("strategy")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in registry.STRATEGIES:
            known = ", ".join(repr(n) for n in registry.names())
            close = difflib.get_close_matches(value, list(registry.STRATEGIES), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"input should be one of {known} (got {value!r}){hint}")
        return value

    @model_validator(mode="after")
    def _bounds_average(self) -> AggregationSpec:
        if (self.clip_norm is not None or self.max_weight_share is not None) and \
                registry.get(self.strategy).robust:
            raise ValueError(f"{self.strategy} bounds a minority's influence by its own rule; "
                             "clip_norm and max_weight_share apply to the averaging "
                             "strategies: remove them or choose fedavg")
        return self

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, value: str | int) -> str | int:
        from xffl.core.errors import InvalidInput
        from xffl.core.sizes import parse_size

        try:
            parse_size(value)
        except InvalidInput as exc:
            raise ValueError(exc.message.rstrip(".")) from None
        return value

    @field_validator("params")
    @classmethod
    def _known_params(cls, value: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        strategy = info.data.get("strategy")
        known = registry.STRATEGIES[strategy].defaults if strategy in registry.STRATEGIES \
            else {}
        for key in value if strategy is not None else ():
            if key not in known:
                close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else (
                    f"its parameters: {', '.join(known) or 'none'}")
                raise ValueError(f"{strategy} has no parameter {key!r}; {hint}")
        return value


class SiteBudget(_Strict):
    """A site's own round budget, replacing the job's: steps, tokens or seconds of training.

    Facilities differ in speed; a slow one can be given fewer steps (or a time budget) so
    that it does not hold every round back. ``time`` sets the site's ``time_budget``.
    """

    steps: int | None = Field(default=None, ge=1, description="optimizer steps per round")
    tokens: int | None = Field(default=None, ge=1, description="tokens per round (sets steps)")
    time: float | None = Field(default=None, gt=0, description="seconds of training")

    @model_validator(mode="after")
    def _something(self) -> SiteBudget:
        if self.steps is None and self.tokens is None and self.time is None:
            raise ValueError("give steps, tokens or time (seconds), or leave budget out")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("give steps or tokens, not both")
        return self

    def apply(self, training: TrainingSpec) -> TrainingSpec:
        """The job's training settings with this site's budget in place."""
        update: dict[str, object] = {}
        if self.steps is not None:
            update.update(steps=self.steps, tokens=None)
        if self.tokens is not None:
            update["tokens"] = self.tokens
        if self.time is not None:
            update["time_budget"] = self.time
        return training.model_copy(update=update)


class SiteSpec(_Strict):
    """One facility taking part in the job."""

    name: str = Field(description="the site's name in this job (letters, digits, - and _)")
    profile: str = Field(description="the site profile it runs with (NAME.yaml)")
    ranks: int = Field(default=1, ge=1, le=4096, description="training processes at the site")
    data: DataSpec = Field(description="its private data, at the site")
    slurm: SlurmOverride | None = Field(
        default=None, description="this site's overrides of its profile's slurm section "
        "(partition, account, qos, time, nodes, ...); only for SLURM profiles")
    budget: SiteBudget | None = Field(
        default=None, description="this site's round budget (steps, tokens or time)")
    startup: float | None = Field(
        default=None, gt=0, description="with round_deadline: seconds from this site's job "
        "start to its first step before one is measured (default round_deadline.startup)")

    _name = field_validator("name")(check_name)

    @field_validator("name")
    @classmethod
    def _no_round_suffix(cls, value: str) -> str:
        if _ROUND_SUFFIX.search(value):
            raise ValueError(f"{value!r} ends like a round number (-r<N>), which SLURM job "
                             "names xffl-<run>-<site>-r<round> reserve; rename the site")
        return value


class FailurePolicy(_Strict):
    """What a round does when sites fail: retry them, then go on with a quorum or stop.

    A site's job that fails (the job, its training, or its submission) is run again up to
    ``retries`` times in the same round; the round then aggregates if at least ``min_sites``
    valid updates arrived (default: every site), else the run stops as failed with the
    reason. ``round_timeout`` (seconds) bounds a round's training, queue waits included:
    sites still running then count as failed (their jobs are cancelled).
    """

    retries: int = Field(default=0, ge=0, le=100,
                         description="runs of a failed site's job again in the same round")
    min_sites: int | None = Field(default=None, ge=1, description="valid updates a round "
                                 "needs to aggregate (null: every site)")
    round_timeout: float | None = Field(default=None, gt=0, description="seconds a round's "
                                        "training may take, queue waits included")
    retry_delay: float = Field(default=0.0, ge=0, le=86_400,
                               description="seconds to wait before a retry")


class JobSpec(_Strict):
    """A federated training job: model, local training, aggregation, rounds, sites."""

    name: str = Field(description="prefix of the run ids (letters, digits, - and _)")
    rounds: int = Field(ge=1, le=100_000, description="federated rounds")
    model: ModelSpec = Field(default_factory=ModelSpec, description="what is trained")
    training: TrainingSpec = Field(default_factory=TrainingSpec,
                                   description="the local training at every site")
    aggregation: AggregationSpec = Field(default_factory=AggregationSpec,
                                         description="how the updates are combined")
    exchange: ExchangeSpec = Field(default_factory=ExchangeSpec,
                                   description="what each site sends back: weights or a "
                                   "delta, and in which dtype")
    failure: FailurePolicy = Field(default_factory=FailurePolicy,
                                   description="retries, quorum and round deadline")
    round_deadline: RoundDeadline | None = Field(
        default=None, description="size each site's local steps so that its update is "
        "expected within {seconds: S} of the round's start, from its measured queue wait, "
        "start-up and speed: {seconds, min_steps, max_steps, startup, staleness}")
    evaluation: EvaluationSpec = Field(
        default_factory=EvaluationSpec, description="how many held-out sequences each site "
        "evaluates every round (sites with data.validation)")
    tracking: TrackingSpec | None = Field(
        default=None, description="log every round's numbers on the coordinator: "
        "{tensorboard: DIR, mlflow: URI} (relative paths: from the job file's folder)")
    sites: list[SiteSpec] = Field(min_length=1, description="the facilities taking part")

    _name = field_validator("name")(check_name)

    @classmethod
    def of_run(cls, run_dir: Path) -> JobSpec:
        """The job spec a run's plan was written from (its validated ``job.json``)."""
        return cls.model_validate_json(RunLayout(run_dir).job_json.read_text())

    @property
    def freeze_a(self) -> bool:
        """Whether LoRA's A matrices stay at their initial values (aggregation.lora)."""
        return self.training.lora is not None and self.aggregation.lora == "freeze_a"

    @property
    def quorum(self) -> int:
        """Valid updates a round needs: ``failure.min_sites``, else every site."""
        return self.failure.min_sites or len(self.sites)

    @model_validator(mode="after")
    def _quorum_fits(self) -> JobSpec:
        if self.failure.min_sites is not None and self.failure.min_sites > len(self.sites):
            raise ValueError(f"failure.min_sites is {self.failure.min_sites} but the job has "
                             f"{len(self.sites)} site(s); use at most {len(self.sites)}")
        return self

    @field_validator("round_deadline")
    @classmethod
    def _adopt_plain(cls, value: RoundDeadline | None,
                     info: ValidationInfo) -> RoundDeadline | None:
        exchange = info.data.get("exchange")
        if value is not None and value.late == "adopt" and exchange is not None \
                and not exchange.plain:
            raise ValueError("late: adopt admits a late update as its change from the global "
                             "it started from, which needs the plain exchange; remove "
                             "exchange's update/dtype settings, or use late: wait")
        return value

    @model_validator(mode="after")
    def _stop_needs_validation(self) -> JobSpec:
        if self.training.stop_when is not None:
            missing = [s.name for s in self.sites if s.data.validation is None]
            if missing:
                raise ValueError(f"training.stop_when watches the federated validation loss, "
                                 f"but site(s) {', '.join(missing)} have no data.validation; "
                                 "give every site data.validation (e.g. {fraction: 0.1})")
        return self

    @field_validator("sites")
    @classmethod
    def _unique_sites(cls, sites: list[SiteSpec]) -> list[SiteSpec]:
        seen: dict[str, int] = {}
        for i, site in enumerate(sites):
            if site.name in seen:
                raise ValueError(
                    f"site name {site.name!r} appears twice (sites[{seen[site.name]}] and "
                    f"sites[{i}]); give each site its own name"
                )
            seen[site.name] = i
        return sites
