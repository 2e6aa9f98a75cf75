"""A run's resolved site profiles read as plain JSON, for the questions `xffl status` asks.

``profiles.json`` is written by xffl at submit from validated profiles. Validating it again
builds pydantic's models, half of a ``xffl status`` of a run whose sites are all local, so
the two questions status asks of every run are answered from the JSON itself; anything
else (and anything malformed) goes through ``slurm_view.load_profiles``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xffl.core.layout import RunLayout


def _profiles(run_dir: Path) -> dict[str, Any] | None:
    """The raw profiles by site; {} without the file, None when it cannot be read."""
    path = RunLayout(run_dir).profiles
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(isinstance(p, dict) for p in data.values()):
        return None
    return data


def may_log_in(run_dir: Path) -> bool:
    """Whether a site of the run may log in over SSH (True when the file cannot be read)."""
    data = _profiles(run_dir)
    if data is None:
        return True
    return any(not isinstance(p.get("connector"), dict) or p["connector"].get("type") != "local"
               for p in data.values())


def slurm_site_names(run_dir: Path) -> frozenset[str]:
    """The sites of a run that submit SLURM jobs (none when the profiles cannot be read)."""
    data = _profiles(run_dir) or {}
    return frozenset(name for name, p in data.items() if p.get("slurm") is not None)
