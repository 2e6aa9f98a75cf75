"""The one interface of every experiment-tracking backend (as torchtitan's metric loggers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xffl.jobs.registry.records import RunRecord


class Tracker(ABC):
    """One tracking backend: logs each completed round's scalars to its target."""

    backend = "tracker"  # its name in warnings

    def __init__(self, target: str) -> None:
        self.target = target  # where it logs: a folder or a URI

    def warm_imports(self) -> None:
        """Import the backend's own library (the warm step server does, once, before it forks
        the rounds' aggregate steps); a backend with nothing heavy to import does nothing."""
        return None

    @abstractmethod
    def log(self, run: RunRecord, params: dict[str, Any], step: int, wall_time: float,
            scalars: dict[str, float]) -> None:
        """Log round ``step`` of ``run`` (and the job's ``params`` when it starts the run)."""
