"""Find site profiles by name: ./site_profiles/, the job's folder, the user's config, bundled."""

from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.names import NAME_RE, NAME_RULE
from xffl.core.validation import validate_doc
from xffl.core.yamlio import load_yaml
from xffl.site_profiles.schema import SiteProfile, SshConnector

PLACEHOLDER = "YOUR_"  # what the bundled templates hold where the user's values go


def bundled_dir() -> Path:
    """The folder of the profiles shipped with xffl."""
    return Path(str(resources.files("xffl.site_profiles") / "bundled"))


def installed_dirs() -> list[Path]:
    """The folders of installed profiles: the user's config folder, then the bundled ones."""
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [config_home / "xffl" / "site_profiles", bundled_dir()]


def install_template(name: str, *, replace: bool = False) -> Path:
    """Copy the bundled template ``name``, comments included, into the user's profiles folder
    (``installed_dirs()[0]``, 0700), owner-only; its path.

    An unknown template, or a copy already there without ``replace``, is an InvalidInput.
    """
    template = bundled_dir() / f"{name}.yaml"
    if not template.is_file():
        known = ", ".join(sorted(p.stem for p in bundled_dir().glob("*.yaml")))
        raise InvalidInput(f"no bundled profile template {name!r}; the templates: {known}.")
    target = installed_dirs()[0] / f"{name}.yaml"
    if target.exists() and not replace:
        raise InvalidInput(f"{target} exists; edit it, or --force to replace it with the "
                           "template.")
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    target.write_text(template.read_text())
    target.chmod(0o600)
    return target


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
        here, mine = search_path(job_dir)[0], installed_dirs()[0]
        raise InvalidInput(
            f"{prefix}site profile {name!r} not found; {hint} "
            f"(or write {here / f'{name}.yaml'}, or {mine / f'{name}.yaml'} for every job)."
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


def placeholders(profile: SiteProfile) -> list[str]:
    """Fields still holding a ``YOUR_...`` placeholder."""
    found = []
    conn = profile.connector
    if isinstance(conn, SshConnector):
        for key in ("host", "user", "key_file", "certificate", "renew"):
            if PLACEHOLDER in str(getattr(conn, key) or ""):
                found.append(key)
    if profile.slurm is not None and PLACEHOLDER in str(profile.slurm.account or ""):
        found.append("account")
    if PLACEHOLDER in (profile.python or ""):
        found.append("python")
    if PLACEHOLDER in profile.workdir:
        found.append("workdir")
    return found


def unfilled(name: str, profile: SiteProfile, job_dir: Path | None = None,
             referrer: str = "") -> list[str]:
    """One error per field of ``name``'s profile still holding a template's ``YOUR_...`` value,
    at its line in the file it came from, with the fix."""
    missing = placeholders(profile)
    if not missing:
        return []
    path = available(job_dir)[name]
    lines = path.read_text().splitlines()
    prefix = f"{referrer}: " if referrer else ""
    bundled = path.parent.resolve() == bundled_dir().resolve()
    fix = (f"copy the template with `xffl profiles init {name}` and fill it in there" if bundled
           else "fill it in")
    errors = []
    for key in missing:
        line = next((n for n, text in enumerate(lines, 1)
                     if re.match(rf"\s*{key}\s*:", text) and PLACEHOLDER in text.split("#")[0]),
                    None)
        where = f"{path}:{line}" if line else str(path)
        errors.append(f"{prefix}{where}: site profile field {key}: still the template's "
                      f"{PLACEHOLDER}... placeholder; {fix}.")
    return errors
