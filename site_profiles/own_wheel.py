"""This xffl's own wheel: the source checkout it runs from, and the wheel built from it.

`xffl profiles image` puts the wheel beside an image definition and `xffl profiles install`
into a site's wheelhouse; both build it here, from the code that runs (the checkout of an
editable install), never from an index, so that a site runs exactly this version.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from xffl.core.errors import InvalidInput, RunFailed

BUILD_TIMEOUT = 600.0


def source_dir(fix: str) -> Path:
    """The checkout this xffl runs from (its pyproject.toml names xffl); InvalidInput
    ending with ``fix`` when xffl runs from an installed wheel instead."""
    import xffl.core

    root = Path(xffl.core.__file__).resolve().parents[1]
    project = root / "pyproject.toml"
    if not project.is_file() or 'name = "xffl"' not in project.read_text():
        raise InvalidInput(f"xffl runs from {root}, which is not a source checkout, so its "
                           f"wheel cannot be built here; {fix}")
    return root


def build_wheel(out: Path, fix: str) -> Path:
    """Build this xffl's wheel into ``out`` (no index, no build isolation: setuptools is the
    venv's own) and return it; setuptools' work folders left in the checkout are removed
    unless they were there before. ``fix`` ends the error when there is no checkout or the
    build fails."""
    source = source_dir(fix)
    leftovers = [p for p in (source / "build", source / "xffl.egg-info") if not p.exists()]
    with tempfile.TemporaryDirectory(prefix="xffl-wheel-") as tmp:
        try:
            built = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                                    "wheel", "-q", "--no-deps", "--no-build-isolation",
                                    "--no-index", "-w", tmp, str(source)],
                                   capture_output=True, text=True, check=False,
                                   timeout=BUILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RunFailed(f"building xffl's wheel from {source} did not finish in "
                            f"{BUILD_TIMEOUT:.0f} s; {fix}") from None
        finally:
            for path in leftovers:
                shutil.rmtree(path, ignore_errors=True)
        if built.returncode != 0:
            tail = " | ".join((built.stderr or built.stdout).strip().splitlines()[-3:])
            raise RunFailed(f"building xffl's wheel from {source} failed ({tail}); {fix}")
        (made,) = Path(tmp).glob("xffl-*.whl")
        out.mkdir(parents=True, exist_ok=True)
        target = out / made.name
        shutil.copyfile(made, target)
        return target
