"""What the run registry records: runs, rounds, each site's round, transfers, evaluations."""

from __future__ import annotations

from dataclasses import dataclass, field

from xffl.jobs.registry.states import RoundState, RunState, SiteState


@dataclass
class RunRecord:
    """One row of ``runs``."""

    id: str
    name: str
    job_path: str
    run_dir: str
    state: RunState
    rounds_total: int
    rounds_done: int
    sites: list[str]
    created: float
    updated: float
    started: float | None = None
    ended: float | None = None
    runner_pid: int | None = None
    message: str = ""

    @property
    def finished(self) -> bool:
        """Whether the run reached a terminal state."""
        return self.state.terminal


@dataclass
class SiteRound:
    """One site's outcome in one round."""

    site: str
    state: SiteState
    num_samples: int | None = None
    num_tokens: int | None = None
    loss: float | None = None
    train_seconds: float | None = None
    reason: str = ""
    attempts: int = 1
    # seconds from the round's start until the site's update was in place on the coordinator
    delivered_seconds: float | None = None
    # seconds from the site's launcher start to its first training step (imports, process
    # group, loading the global model and the data)
    startup_seconds: float | None = None
    # mean token loss on the site's held-out sequences of the global model the round started
    # from, and of the site's own trained update; how many sequences were evaluated, and
    # how many of their targets are in the loss (every one of text data; the responses of
    # instruction and chat data): the site's weight in the federated validation loss
    val_loss: float | None = None
    val_loss_update: float | None = None
    val_samples: int | None = None
    val_tokens: int | None = None
    # an update that started from an older global (round_deadline.late: adopt): the rounds it
    # is late and the factor s(staleness) its change was applied with; a late site's job id
    staleness: int | None = None
    staleness_weight: float | None = None
    late_job_id: str | None = None
    # how the site's hardware ran the round (xffl.training.telemetry): the device's name,
    # its GPUs (0 on CPUs), one device's steady-state tokens/s and achieved TFLOP/s, MFU
    # (None where the device's peak is unknown), the ranks' largest peak memory (GPU memory,
    # on CPUs the resident set) and the seconds writing the update took
    device: str | None = None
    gpus: int | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    save_seconds: float | None = None
    # training.local_groups: the bytes a rank all-reduced for the groups' syncs, per
    # optimizer step (a sync's / every) and in the round
    group_bytes_per_step: float | None = None
    group_bytes_round: float | None = None


@dataclass(frozen=True)
class Transfer:
    """One copy StreamFlow made between the coordinator and a site (epoch times)."""

    site: str
    direction: str  # "in" (to the site) or "out" (back to the coordinator)
    started: float
    ended: float
    bytes: int | None = None  # the files' bytes, as they lie on the coordinator


@dataclass
class RoundRecord:
    """One round of a run with its sites."""

    round: int
    state: RoundState
    started: float | None = None
    ended: float | None = None
    aggregate_seconds: float | None = None
    global_path: str | None = None
    global_digest: str | None = None
    num_samples: int | None = None
    loss: float | None = None
    # the federated validation loss of the global model the round started from: the mean
    # over every site's held-out targets in the loss, i.e. the sites' val_loss weighted by
    # their val_tokens (val_tokens: their sum; val_samples: the sequences behind them)
    val_loss: float | None = None
    val_samples: int | None = None
    val_tokens: int | None = None
    sites: list[SiteRound] = field(default_factory=list)


@dataclass(frozen=True)
class EvalCell:
    """One cell of a cross-site evaluation: ``model`` (``global`` or a site's update of that
    round) evaluated on ``data_site``'s held-out sequences (``samples`` of them)."""

    round: int
    data_site: str
    model: str
    loss: float
    samples: int


@dataclass(frozen=True)
class FinalLoss:
    """The final model's held-out loss: after the last round every site evaluated the final
    global (the global after ``round``) on its held-out data, as in every round; the mean
    over all the sites' held-out targets and the median across the sites' own losses."""

    round: int
    val_loss: float
    val_loss_median: float
    val_samples: int
    val_tokens: int
    sites: dict[str, float]  # each site's own mean loss
    site_tokens: dict[str, int]  # each site's held-out targets in the loss: its weight
