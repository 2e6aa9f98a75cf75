"""The schedulers xffl knows, by name, and the one whose job this process runs in."""

from __future__ import annotations

import os
from collections.abc import Mapping

from xffl.core.errors import InvalidInput
from xffl.schedulers.base import Ranks, Scheduler
from xffl.schedulers.slurm import SLURM

SCHEDULERS: dict[str, Scheduler] = {SLURM.name: SLURM}


def scheduler(name: str, where: str = "the site profile's scheduler") -> Scheduler:
    """The scheduler called ``name``; InvalidInput naming ``where`` and the known ones."""
    found = SCHEDULERS.get(name)
    if found is None:
        raise InvalidInput(f"{where}: unknown scheduler {name!r}; use one of "
                           f"{', '.join(sorted(SCHEDULERS))}.")
    return found


def current(environ: Mapping[str, str] | None = None) -> Scheduler | None:
    """The scheduler whose job these variables (the process's own by default) belong to."""
    env = os.environ if environ is None else environ
    return next((s for s in SCHEDULERS.values() if s.in_job(env)), None)


def step_ranks(environ: Mapping[str, str]) -> tuple[Scheduler, Ranks] | None:
    """The scheduler whose job step these variables are, with the step's rank; None if none."""
    for sched in SCHEDULERS.values():
        found = sched.ranks(environ)
        if found is not None:
            return sched, found
    return None
