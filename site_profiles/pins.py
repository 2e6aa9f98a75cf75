"""This coordinator's xffl as a site must install it: its version, its source checkout and
the exact versions of its dependencies installed here (torch aside: the site's own build)."""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import metadata

from packaging.requirements import Requirement

from xffl.core.errors import InvalidInput
from xffl.core.startup import collect_less
from xffl.site_profiles import own_wheel

#: left to the site: torch is its own build (CUDA, ROCm) from its module or a torch index,
#: and what only torch needs (sympy, triton, the nvidia-* libraries) comes with it
SITE_OWN = frozenset({"torch"})
#: the coordinator's own: a site trains, evaluates and prepares data; it never runs the
#: workflow (StreamFlow, cwltool), logs in to other hosts (paramiko, cryptography), keeps a
#: crontab or draws the report. Leaving them out takes a site's install from 106 packages to
#: 44 (the site's code imports none of them: tests/site_profiles/test_pins.py)
COORDINATOR_ONLY = frozenset({"streamflow", "cwltool", "paramiko", "cryptography", "croniter",
                              "python-crontab", "matplotlib"})
#: the checkout's folders (pyproject.toml's package-dir) whose files make the xffl wheel
#: how to get a wheel when xffl runs from an installed wheel, not a checkout
INSTALL_FIX = ("run `xffl profiles install` from a checkout's venv (scripts/setup-venv.sh), "
               "which builds the wheel the site installs.")
SOURCE_DIRS = ("aggregator", "cli", "core", "jobs", "site_profiles", "training", "workflows",
               "docs/json", "examples")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def pinned_requirements() -> tuple[str, ...]:
    """``name==version`` of every distribution a site's xffl needs (its requirements and
    theirs, with their environment markers evaluated here, no extras), as installed in this
    environment; torch (:data:`SITE_OWN`), the coordinator's own packages
    (:data:`COORDINATOR_ONLY`) and what only those need left out."""
    pins: dict[str, str] = {}
    todo = ["xffl"]
    while todo:
        dist = metadata.distribution(todo.pop())
        for text in dist.requires or ():
            req = Requirement(text)
            key = canonical(req.name)
            if key in SITE_OWN or key in COORDINATOR_ONLY or key in pins or (
                    req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                pins[key] = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                raise InvalidInput(f"{req.name}, which xffl needs, is not installed here; "
                                   "install xffl's dependencies (scripts/setup-venv.sh) "
                                   "first.") from None
            todo.append(req.name)
    return tuple(f"{k}=={v}" for k, v in sorted(pins.items()))


def torch_version() -> str:
    """This coordinator's torch version without a local label (``2.6.0+cpu`` -> ``2.6.0``)."""
    return metadata.version("torch").split("+")[0]


@cache
def source_digest() -> str:
    """sha256 of the checkout's files that make the wheel (names and bytes): a change there
    is a new wheel, and a site install that is no longer current."""
    root = own_wheel.source_dir(INSTALL_FIX)
    digest = hashlib.sha256()
    for name in ("pyproject.toml", *SOURCE_DIRS):
        path = root / name
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for file in files:
            digest.update(f"{file.relative_to(root)}\0{file.stat().st_size}\0".encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def main() -> None:
    """Print the pins, one a line (scripts/site-wheels.sh downloads them)."""
    collect_less()  # first, as in every entry point (see xffl.core.startup)
    print("\n".join(pinned_requirements()))


if __name__ == "__main__":
    main()
