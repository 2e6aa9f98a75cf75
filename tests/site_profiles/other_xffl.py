"""A real Python whose xffl is another one: another version and another exchange format.

The wrapper runs this venv's interpreter with a folder first on PYTHONPATH holding what an
xffl install of another version leaves there for Python to find: its ``.dist-info`` (so
``importlib.metadata.version('xffl')`` answers that version) and a ``sitecustomize`` that gives
xffl's exchange format another number before anything of xffl is imported (so the probe reads
it, and a trainer run with it writes manifests of that format).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def other_xffl_python(folder: Path, version: str = "9.9.9", fmt: int = 99,
                      base: str = sys.executable) -> Path:
    """Write ``folder/python`` (and what it puts on PYTHONPATH beside it), which runs
    ``base`` (this venv's interpreter, or another venv's with xffl); return its path."""
    lib = folder / "other-xffl"
    info = lib / f"xffl-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: xffl\nVersion: {version}\n")
    (lib / "sitecustomize.py").write_text(
        f"import xffl.core.versions\nxffl.core.versions.FORMAT_VERSION = {fmt}\n")
    python = folder / "python"
    python.write_text("#!/bin/sh\n"
                      f"PYTHONPATH={shlex.quote(str(lib))}${{PYTHONPATH:+:$PYTHONPATH}} "
                      f"exec {shlex.quote(base)} \"$@\"\n")
    python.chmod(0o755)
    return python


def refusal(job: Path, python: Path | str, profile: str) -> str:
    """The sentence ``xffl submit`` of ``job`` must refuse site alpha (on site profile
    ``profile``) with, its Python being :func:`other_xffl_python`'s (defaults): the site,
    that Python, both xffl versions, both formats and `xffl profiles install PROFILE`."""
    from xffl.core.versions import FORMAT_VERSION, xffl_version

    return (f"{job}: site 'alpha': its Python {python} has xffl 9.9.9, which writes exchange "
            f"format 99, where this xffl {xffl_version()} reads format {FORMAT_VERSION}; "
            f"install this xffl {xffl_version()} there: `xffl profiles install {profile}`.")
