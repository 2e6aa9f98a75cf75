"""Schemas of the training sections of a job spec (model, training loop, per-site data)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """Which model to train: a bundled preset, optionally with config fields overridden.

    Field names of ``overrides`` are Hugging Face LlamaConfig names (hidden_size, ...).
    ``init`` is an existing checkpoint directory (HF LLaMA layout) to start from instead of
    a random initialisation.
    """

    preset: str = "tiny"
    overrides: dict[str, int | float | bool] = Field(default_factory=dict)
    init: str | None = None


class TrainingSpec(_Strict):
    """The local training loop each site runs every round."""

    steps: int = Field(default=20, ge=1, description="optimizer steps per round")
    batch_size: int = Field(default=8, ge=1, description="sequences per step per rank")
    seq_len: int = Field(default=64, ge=8, le=1 << 16)
    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, ge=0)
    seed: int = Field(default=0, ge=0)


class DataSpec(_Strict):
    """Where a site's token shards live, on that site's filesystem (never transferred).

    ``path`` may be absolute or relative to the site profile's ``workdir``. With
    ``synthetic`` set, the shards are generated deterministically there on first use.
    """

    path: str
    synthetic: Literal["alpha", "beta", "gamma", "delta"] | None = None
    synthetic_sequences: int = Field(default=512, ge=1)

    @model_validator(mode="after")
    def _path_not_empty(self) -> DataSpec:
        if not self.path.strip():
            raise ValueError("path must not be empty")
        return self


class TrainJob(_Strict):
    """What the trainer receives for one site and round (written to a JSON file by the plan)."""

    run_id: str
    site: str
    model: ModelSpec
    training: TrainingSpec
    data: DataSpec
