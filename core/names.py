"""Names that end up in CWL ids, SLURM job names, paths and shell lines: the one rule for them."""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
NAME_RULE = "lower-case letters, digits, '-' or '_', starting with a letter, at most 32 characters"


def check_name(value: str) -> str:
    """Names end up in CWL ids, SLURM job names, paths and shell lines: keep them plain."""
    if not NAME_RE.match(value):
        raise ValueError(f"{value!r} is not a valid name; use {NAME_RULE}")
    return value


def slurm_job_name(run_id: str, site: str, rnd: int | str | None = None) -> str:
    """The SLURM job name of ``site``'s train job in ``run_id``: ``xffl-<run>-<site>-r<round>``.

    Without ``rnd`` it is the run's and site's prefix, which a job carries when it was
    submitted without its round (``xffl render``'s script, before the launcher renames it).
    """
    prefix = f"xffl-{run_id}-{site}"
    return prefix if rnd is None else f"{prefix}-r{rnd}"


def slurm_job_round(name: str, run_id: str, site: str) -> int | None:
    """The round in a job name of ``site`` in ``run_id`` (0: the prefix only); None if not ours.

    Site names cannot end in ``-r<digits>`` (jobs/spec/schema.py), so this never mistakes another
    site's job for one of ``site``'s.
    """
    prefix = slurm_job_name(run_id, site)
    if name == prefix:
        return 0
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    if rest.startswith("-r") and rest[2:].isdigit() and rest[2:].isascii():
        return int(rest[2:])
    return None
