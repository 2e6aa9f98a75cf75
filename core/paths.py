"""Where xffl keeps its state: the data directory (XFFL_HOME) and the run directories.

Everything xffl writes is its user's alone: runs, registry, updates and globals can leak
training data, profiles name keys. Entry points call :func:`private_files` (umask 077), and
the data directory itself is made 0700 whenever the registry opens it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

OWNER_ONLY_UMASK = 0o077


def private_files() -> None:
    """From now on, files and folders this process creates are its user's alone (umask 077)."""
    os.umask(OWNER_ONLY_UMASK)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) as 0700, or take group and other access off it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077 and path.stat().st_uid == os.getuid():
        path.chmod(mode & 0o700)
    return path


def xffl_home() -> Path:
    """The data directory: $XFFL_HOME, else $XDG_DATA_HOME/xffl, else ~/.local/share/xffl."""
    if env := os.environ.get("XFFL_HOME"):
        return Path(env).expanduser().resolve()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return (Path(base) / "xffl").resolve()


def config_dir() -> Path:
    """The user's xffl configuration folder: $XDG_CONFIG_HOME/xffl, else ~/.config/xffl."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "xffl"


def runs_dir() -> Path:
    """The folder that holds one run directory per run."""
    return xffl_home() / "runs"


def registry_path() -> Path:
    """The SQLite run registry."""
    return xffl_home() / "registry.db"
