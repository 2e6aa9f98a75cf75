"""The scheduler seam: everything xffl asks of a facility's batch scheduler, in one protocol.

A scheduler speaks its own dialect in four places, and each is a method here:

* the batch script: a site's options and the directive lines of a round's job
  (:meth:`Scheduler.batch_options`, :meth:`Scheduler.name_directive`,
  :meth:`Scheduler.directives`);
* the login node: the shell lines that list the user's jobs, print the ids of a name
  prefix's jobs, cancel them, and estimate when a job would start, and the parsers of what
  the facility answers (its text is not trusted: a line that is not the scheduler's is
  skipped);
* a rank of a job step: the variables that say its rank, world and rendezvous address, and
  when the job's time limit runs out;
* the job itself: its record at start (renamed after the round where it is not yet).

The StreamFlow side (submit, poll, cancel of the round's job) is StreamFlow's connector for
the scheduler, with xffl's deadline logic mixed in (:mod:`xffl.workflows.extensions.deadline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Ranks:
    """Where a rank of a job step stands, read from the scheduler's variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class QueuedJob:
    """One job as the scheduler's queue listing shows it (fields checked, times in seconds)."""

    job_id: str
    name: str
    state: str
    nodes: str
    queue_wait_s: float | None
    run_s: float | None


@runtime_checkable
class Scheduler(Protocol):
    """A batch scheduler's dialect: directives, login-node commands, rank variables, record."""

    name: str  # the registry's name, and DistEnv.source in its job steps
    #: StreamFlow's connector of the scheduler (module:class), which xffl's deadline logic
    #: is mixed into (xffl.workflows.extensions.connectors builds ``xffl-<name>`` from it)
    streamflow_connector: str
    job_word: str  # how messages name one of its jobs: "SLURM job"
    cancelled_word: str  # what a job it cancelled is called: "scancelled"

    def batch_options(self, settings: Mapping[str, object], extra: Sequence[str]) -> list[str]:
        """The scheduler's options for a site's settings (partition, account, qos, mem, ...:
        the profile's fields, None when unset), the site's own ``extra`` options last."""
        ...

    def name_directive(self, job_name: str) -> str:
        """The batch script's line naming the job."""
        ...

    def directives(self, nodes: int, ranks: int, time: str, options: Sequence[str],
                   signal_margin: int | None = None) -> list[str]:
        """The batch script's scheduler lines of a round's job (``options``: batch_options;
        ``signal_margin``: the scheduler signals the batch shell USR1 that many seconds before
        the time limit, for a round of several jobs)."""
        ...

    def list_command(self) -> str:
        """The login-node shell line printing the clock, then every job of the user."""
        ...

    def parse_list(self, text: str) -> list[QueuedJob]:
        """What :meth:`list_command` printed, as jobs (lines that are not the scheduler's
        are skipped)."""
        ...

    def job_ids_command(self, prefix: str) -> str:
        """A shell line printing the ids of the user's jobs named ``prefix`` or
        ``prefix-r<digits>``."""
        ...

    def cancel_command(self, prefix: str, names: Sequence[str]) -> str:
        """A shell line cancelling the jobs of ``prefix`` (by id) and those named ``names``;
        exit status 0 when every cancel by name succeeded."""
        ...

    def estimate_command(self, nodes: int, ranks: int, time: str,
                         options: Sequence[str]) -> str:
        """The login-node shell line: the clock, then the scheduler's start estimate of a
        round's job (nothing submitted)."""
        ...

    def parse_estimate(self, text: str) -> float | None:
        """Seconds from the login node's clock to the estimated start, or None."""
        ...

    def in_job(self, environ: Mapping[str, str]) -> bool:
        """Whether these variables are those of one of this scheduler's jobs."""
        ...

    def ranks(self, environ: Mapping[str, str]) -> Ranks | None:
        """A job step's rank from its variables; None outside a job step."""
        ...

    def end_time(self, environ: Mapping[str, str]) -> float | None:
        """When the job's time limit runs out (epoch seconds); None: no limit, no job."""
        ...

    def job_start(self, name: str | None, environ: Mapping[str, str]) -> dict[str, Any] | None:
        """At the job's start: rename it to ``name`` if needed and return its record."""
        ...
