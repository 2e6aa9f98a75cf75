"""A site's outcome in one round, as the admit step writes it and the aggregate step reads it.

``verdict.json`` is an output of the round's ``admit_<site>`` step (CWL File), written on the
coordinator: the site's name in it is the coordinator's own. The aggregate step records every
site's verdict in the registry and aggregates the updates whose verdict is ``completed``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xffl.core.words import capped
from xffl.jobs.registry.records import SiteRound
from xffl.jobs.registry.states import SiteState

VERDICT_FILE = "verdict.json"


@dataclass
class Verdict:
    """What became of one site's update in one round."""

    site: str
    round: int
    state: SiteState  # completed, rejected or failed
    reason: str = ""
    attempts: int = 1
    num_samples: int | None = None
    num_tokens: int | None = None
    loss: float | None = None
    train_seconds: float | None = None
    startup_seconds: float | None = None
    val_loss: float | None = None  # the incoming global's, on the site's held-out data
    val_loss_update: float | None = None  # the site's trained update's
    val_samples: int | None = None  # held-out sequences those were measured on
    val_tokens: int | None = None  # their targets in the loss: the site's federated weight
    delivered_at: float | None = None  # epoch time the update was on the coordinator
    digest: str | None = None  # the admitted update's manifest digest
    staleness: int | None = None  # rounds late (an adopted late job's update)
    staleness_weight: float | None = None  # s(staleness): the factor its change is applied with
    late_job_id: str | None = None  # the SLURM job left running (state late)
    device: str | None = None  # the site's hardware (xffl.jobs.registry.records.SiteRound), checked
    gpus: int | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    save_seconds: float | None = None
    group_bytes_per_step: float | None = None  # training.local_groups: a rank's sync bytes
    group_bytes_round: float | None = None

    def __post_init__(self) -> None:
        """A reason quotes what the site sent: it enters the registry at most REASON_CHARS
        long (:mod:`xffl.core.words`), whatever a check quoted."""
        self.reason = capped(self.reason)

    @property
    def accepted(self) -> bool:
        """Whether the update goes into the aggregate."""
        return self.state == SiteState.COMPLETED

    def site_round(self) -> SiteRound:
        """The registry's row for this site in this round."""
        return SiteRound(site=self.site, state=self.state, num_samples=self.num_samples,
                         num_tokens=self.num_tokens, loss=self.loss,
                         train_seconds=self.train_seconds, reason=self.reason,
                         attempts=self.attempts, startup_seconds=self.startup_seconds,
                         val_loss=self.val_loss, val_loss_update=self.val_loss_update,
                         val_samples=self.val_samples, val_tokens=self.val_tokens,
                         staleness=self.staleness, staleness_weight=self.staleness_weight,
                         late_job_id=self.late_job_id, device=self.device, gpus=self.gpus,
                         tokens_per_s_per_gpu=self.tokens_per_s_per_gpu, tflops=self.tflops,
                         mfu=self.mfu, peak_memory_gib=self.peak_memory_gib,
                         save_seconds=self.save_seconds,
                         group_bytes_per_step=self.group_bytes_per_step,
                         group_bytes_round=self.group_bytes_round)

    def write(self, path: Path) -> None:
        """Store as JSON."""
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


def read_verdict(path: Path) -> Verdict:
    """A verdict written by an admit step."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    data["state"] = SiteState(data["state"])
    return Verdict(**data)
