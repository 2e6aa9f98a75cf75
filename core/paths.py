"""Where xffl keeps its state: the data directory (XFFL_HOME) and the run directories."""

from __future__ import annotations

import os
from pathlib import Path


def xffl_home() -> Path:
    """The data directory: $XFFL_HOME, else $XDG_DATA_HOME/xffl, else ~/.local/share/xffl."""
    if env := os.environ.get("XFFL_HOME"):
        return Path(env).expanduser().resolve()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return (Path(base) / "xffl").resolve()


def runs_dir() -> Path:
    """The folder that holds one run directory per run."""
    return xffl_home() / "runs"


def registry_path() -> Path:
    """The SQLite run registry."""
    return xffl_home() / "registry.db"
