"""Small file primitives every layer uses: atomic writes through a fsynced temporary file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any


def _unique_tmp(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
                           f"{time.monotonic_ns()}")


def atomic_write(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` through a fsynced temporary file and one rename; the file
    is owner-only (0600) whatever the process's umask."""
    tmp = _unique_tmp(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(final: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``final`` atomically and owner-only (parents
    created, owner-only)."""
    final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(final, (json.dumps(data, indent=2) + "\n").encode())


def read_json(path: Path) -> Any:
    """The JSON value in ``path``, or None when there is no such file."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def link_files(src: Path, dst: Path, names: list[str]) -> None:
    """Expose ``src/NAME`` as ``dst/NAME`` for each name, by hard link or else by copy."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            os.link(src / name, dst / name)
        except OSError:
            shutil.copy2(src / name, dst / name)
