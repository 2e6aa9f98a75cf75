"""Find site profiles by name: ./site_profiles/, the job's folder, the user's config, bundled."""

from __future__ import annotations

import difflib
import os
from importlib import resources
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.names import NAME_RE, NAME_RULE
from xffl.core.validation import validate_doc
from xffl.core.yamlio import load_yaml
from xffl.site_profiles.schema import SiteProfile


def bundled_dir() -> Path:
    """The folder of the profiles shipped with xffl."""
    return Path(str(resources.files("xffl.site_profiles") / "bundled"))


def installed_dirs() -> list[Path]:
    """The folders of installed profiles: the user's config folder, then the bundled ones."""
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [config_home / "xffl" / "site_profiles", bundled_dir()]


def search_path(job_dir: Path | None = None) -> list[Path]:
    """Folders searched for ``NAME.yaml``, first match wins."""
    dirs = []
    if job_dir is not None:
        dirs.append(job_dir / "site_profiles")
    dirs += [Path.cwd() / "site_profiles", *installed_dirs()]
    unique: list[Path] = []
    for d in dirs:
        if d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available(job_dir: Path | None = None) -> dict[str, Path]:
    """All profile names reachable from the search path, mapped to their file."""
    found: dict[str, Path] = {}
    for folder in reversed(search_path(job_dir)):
        if folder.is_dir():
            for file in sorted(folder.glob("*.yaml")):
                found[file.stem] = file
    return found


def load_profile_file(path: Path) -> SiteProfile:
    """Load and validate one profile file."""
    profile = validate_doc(load_yaml(path, "site profile"), SiteProfile, "site profile")
    if profile.name != path.stem:
        raise InvalidInput(
            f"{path}: site profile field name: {profile.name!r} differs from the file name "
            f"{path.stem!r}; make them equal."
        )
    return profile


def find_profile(name: str, job_dir: Path | None = None, referrer: str = "") -> SiteProfile:
    """Load the profile called ``name``; an unknown name is an InvalidInput with suggestions."""
    prefix = f"{referrer}: " if referrer else ""
    if not NAME_RE.match(name):
        raise InvalidInput(f"{prefix}{name!r} is not a valid site profile name; use {NAME_RULE}.")
    profiles = available(job_dir)
    if name not in profiles:
        close = difflib.get_close_matches(name, list(profiles), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(profiles))}"
        raise InvalidInput(
            f"{prefix}site profile {name!r} not found; {hint} "
            f"(or add site_profiles/{name}.yaml)."
        )
    chosen = profiles[name]
    installed = [d / f"{name}.yaml" for d in installed_dirs()]
    shadowed = [p for p in installed if p.is_file() and p.resolve() != chosen.resolve()]
    if shadowed and chosen.parent.resolve() not in [d.resolve() for d in installed_dirs()]:
        # a job's folder (perhaps a collaborator's) must not silently redirect a profile the
        # user installed: same name, another host, another key
        raise InvalidInput(
            f"{prefix}site profile {name!r} in {chosen} has the name of the installed "
            f"profile {shadowed[0]}; a job's folder cannot replace an installed profile: "
            f"rename the file and its name field (e.g. {name}-job).")
    return load_profile_file(chosen)
