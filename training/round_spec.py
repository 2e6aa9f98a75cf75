"""The ``training.checkpoint`` section of a job spec (checkpoints inside a round, rounds that
span several jobs) and the margin before a job's time limit that a chained round saves in."""

from __future__ import annotations

import math
import re
from typing import Annotated

from pydantic import BeforeValidator, Field, field_validator

from xffl.core.validation import StrictModel

_MINUTES_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)m$")

#: the signal SLURM sends the batch shell a margin before the time limit (``--signal``)
CHAIN_SIGNAL = "USR1"
#: SLURM sends ``--signal`` up to 60 s before the time it is asked for (its event
#: resolution), and a step in flight must end before the save begins: seconds added to twice
#: the checkpoint's cost (the save itself, and the same again for the step before it)
CHAIN_SAFETY_SECONDS = 60
#: SLURM's largest ``--signal`` time (a 16-bit field)
SIGNAL_MAX_SECONDS = 65535
#: the declared cost of one checkpoint (:func:`checkpoint_seconds`): fp32 weights and AdamW's
#: two fp32 moments, written at the fastest rate ``bench/round_checkpoint`` measured
BYTES_PER_PARAMETER = 12
WRITE_GBPS = 0.4
FIXED_SECONDS = 1.0


def checkpoint_seconds(parameters: int) -> float:
    """The declared estimate of one checkpoint's seconds for a model of ``parameters``."""
    return FIXED_SECONDS + BYTES_PER_PARAMETER * parameters / (WRITE_GBPS * 1e9)


def _every(value: object) -> object:
    """Steps (a whole number >= 1) or ``"<N>m"`` minutes (N > 0): one error for anything else."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        match = _MINUTES_RE.match(value.strip())
        if match and float(match.group(1)) > 0:
            return value.strip()
    raise ValueError(f"every is {value!r}; write a number of optimizer steps (>= 1) or "
                     "minutes as \"<N>m\" (e.g. \"30m\")")


def chain_margin(checkpoint_seconds: float) -> int:
    """Seconds before a job's time limit at which a chained round stops and saves: twice one
    checkpoint's cost (the step in flight, then the save) plus :data:`CHAIN_SAFETY_SECONDS`,
    whole seconds, at most SLURM's largest ``--signal`` time."""
    cost = max(0.0, checkpoint_seconds) if math.isfinite(checkpoint_seconds) else 0.0
    return min(SIGNAL_MAX_SECONDS, math.ceil(2 * cost) + CHAIN_SAFETY_SECONDS)


class RoundCheckpointSpec(StrictModel):
    """Checkpoints inside a round, at the site: a job that ends early is continued.

    Every ``every`` optimizer steps (or ``"<N>m"`` minutes of training) the ranks write a
    sharded checkpoint (torch.distributed.checkpoint) of the model, optimizer, learning-rate
    schedule, data position and RNG into the site's own state folder, never into the update;
    a retried or requeued job of the same run, round and global model continues from the
    newest complete one (:mod:`xffl.training.round_state`). The newest ``keep`` are kept.
    With ``chain`` a round may span several jobs: near its time limit a job saves and ends,
    and the next job of the site continues the round (:mod:`xffl.training.chain`).
    """

    every: Annotated[int | str, BeforeValidator(_every)] = Field(
        description="optimizer steps between checkpoints, or \"<N>m\" minutes of training")
    keep: int = Field(default=2, description="complete checkpoints kept (>= 1)")
    chain: bool = Field(
        default=False, description="let a round span several jobs: near the SLURM time limit "
        "the job checkpoints and ends (exit 75), and the next job continues the round; "
        "false: one job per round, cut short by the time limit (time_budget mode)")

    @field_validator("keep")
    @classmethod
    def _keep(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"keep is {value}; keep at least 1 checkpoint (the newest is the "
                             "one a retried job continues from), or remove training.checkpoint")
        return value

    @property
    def every_steps(self) -> int | None:
        """The interval in steps (None: in minutes)."""
        return self.every if isinstance(self.every, int) else None

    @property
    def every_seconds(self) -> float | None:
        """The interval in seconds (None: in steps)."""
        if isinstance(self.every, int):
            return None
        return float(self.every[:-1]) * 60.0
