"""The states a run, a round and a site's round go through, as the registry records them.

String enums: their values are what the registry stores and ``--json`` prints, and each
member compares equal to its value.
"""

from __future__ import annotations

from enum import Enum


class _State(str, Enum):
    """A state; shown and stored as its value."""

    def __str__(self) -> str:
        return str(self.value)


class RunState(_State):
    """Where a run stands.

    ``submitted`` (registered, its supervisor starting) -> ``running`` (a process holds its
    round lock) -> ``waiting`` (between cron ticks, or for a credential) or a terminal state.
    """

    SUBMITTED = "submitted"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """Whether nothing happens to the run any more (unless it is resumed)."""
        return self in (RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED)


class RoundState(_State):
    """Where a round stands: running until aggregated (completed) or given up."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class SiteState(_State):
    """What became of one site in one round."""

    RUNNING = "running"
    COMPLETED = "completed"  # its update was admitted
    REJECTED = "rejected"  # its update came back and failed admission
    FAILED = "failed"  # no update: the job failed, timed out or the site was unreachable
    LATE = "late"  # no update yet: its SLURM job was left running at the round deadline
    CANCELLED = "cancelled"

    @property
    def delivered(self) -> bool:
        """Whether the site's update reached the coordinator (its delivery time is kept)."""
        return self in (SiteState.COMPLETED, SiteState.REJECTED)
