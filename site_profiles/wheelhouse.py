"""The wheelhouse a site without a package index installs from: this checkout's xffl wheel
and the wheels of its pinned dependencies for the site's Python and platform, built here
once and kept under XFFL_HOME/wheelhouse (a second install for the same site builds
nothing)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from xffl.core.errors import InvalidInput, RunFailed
from xffl.core.paths import xffl_home
from xffl.core.versions import xffl_version
from xffl.site_profiles import own_wheel
from xffl.site_profiles.pins import INSTALL_FIX, pinned_requirements, source_digest
from xffl.site_profiles.site_python import SitePython

REQUIREMENTS = "requirements.txt"
Step = Callable[[str], None]


def requirements() -> list[str]:
    """What the site's pip installs, each pinned: the dependencies, then xffl itself."""
    return [*pinned_requirements(), f"xffl=={xffl_version()}"]


def wheelhouse_key(target: SitePython, deps: bool = True) -> str:
    """The digest of a wheelhouse's contents: xffl's version and source, the pins, the
    target Python and its platforms, whether it holds the dependencies' wheels (the same key
    is the same wheels)."""
    what = {"xffl": xffl_version(), "source": source_digest(), "pins": requirements(),
            "python": target.version, "implementation": target.implementation,
            "platforms": target.platforms(), "deps": deps}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _pip(args: Sequence[str], what: str, timeout: float = 1800) -> None:
    """Run this Python's pip; RunFailed naming ``what`` with pip's last words."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                               *args], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"{what}: pip did not finish in {timeout:.0f} s.") from None
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip()
                and not line.startswith("WARNING")] or [f"exit {proc.returncode}"]
        raise RunFailed(f"{what} failed: {last[-1].strip()}")


def _target_args(target: SitePython) -> list[str]:
    """pip's options that pick the site's wheels (not this machine's)."""
    platforms = target.platforms()
    if not platforms or target.implementation != "cpython":
        raise InvalidInput(f"the site's {target.describe()} is not CPython on Linux; xffl "
                           "builds wheelhouses for those only: name an index the site reaches "
                           "(install.index_url in its profile).")
    abi = "cp" + target.version.replace(".", "")
    return [arg for tag in platforms for arg in ("--platform", tag)] + [
        "--python-version", target.version, "--implementation", "cp", "--abi", abi]


def _build_sdists(folder: Path, out: Path, links: list[str]) -> None:
    """Turn the source distributions pip fetched (packages without wheels) into wheels in
    ``out``: pure Python ones only, since they are built here for another machine."""
    built = folder / "built"
    for sdist in sorted(p for p in folder.iterdir() if p.is_file()
                        and not p.name.endswith(".whl")):
        _pip(["wheel", "-q", "--no-deps", "--no-build-isolation", *links, "-w", str(built),
              str(sdist)], f"building a wheel of {sdist.name}")
    for wheel in sorted(built.glob("*.whl")) if built.is_dir() else []:
        if not wheel.name.endswith("-none-any.whl"):
            raise RunFailed(f"{wheel.name}: its package has no wheel for the site and is not "
                            "pure Python; name an index the site reaches (install.index_url "
                            "in its profile).")
        wheel.rename(out / wheel.name)


def build_wheelhouse(target: SitePython, find_links: Sequence[Path], step: Step,
                     deps: bool = True) -> Path:
    """The site's wheelhouse (built now unless XFFL_HOME already holds it): wheels and a
    requirements.txt of every pin. ``find_links``: fetch from these folders only (no index);
    ``deps``: with the dependencies' wheels (else xffl's alone: the site's index has them)."""
    key = wheelhouse_key(target, deps)
    final = xffl_home() / "wheelhouse" / key
    if (final / REQUIREMENTS).is_file():
        step(f"wheelhouse {final} (built before)")
        return final
    part = final.with_name(key + ".part")
    shutil.rmtree(part, ignore_errors=True)
    (part / "fetched").mkdir(parents=True)
    step(f"building this xffl's wheel ({xffl_version()}) from "
         f"{own_wheel.source_dir(INSTALL_FIX)}")
    own_wheel.build_wheel(part, INSTALL_FIX)
    if deps:
        _fetch(target, find_links, part, step)
    (part / REQUIREMENTS).write_text("\n".join(requirements()) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    part.rename(final)
    return final


def _fetch(target: SitePython, find_links: Sequence[Path], part: Path, step: Step) -> None:
    """Download the pinned dependencies' wheels for ``target`` into ``part``."""
    links = [a for d in find_links for a in ("--find-links", str(d))]
    offline = ["--no-index", *links] if find_links else []
    pins = list(pinned_requirements())
    step(f"fetching {len(pins)} pinned dependencies for the site's {target.describe()}"
         + (f" from {', '.join(map(str, find_links))}" if find_links else ""))
    _pip(["download", "-q", "--no-deps", "--prefer-binary", "--no-build-isolation",
          *_target_args(target), *offline,
          "-d", str(part / "fetched"), *pins], "fetching the wheels for the site")
    wheels = [p for p in (part / "fetched").iterdir() if p.name.endswith(".whl")]
    for wheel in wheels:
        wheel.rename(part / wheel.name)
    _build_sdists(part / "fetched", part, offline)
    shutil.rmtree(part / "fetched")
