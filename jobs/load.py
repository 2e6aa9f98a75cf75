"""Load a job spec and the site profiles it names, with every error pointing at file and field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.validation import validate_doc
from xffl.core.yamlio import load_yaml
from xffl.jobs.spec import JobSpec
from xffl.site_profiles.lookup import find_profile
from xffl.site_profiles.schema import SiteProfile
from xffl.training.model import PRESETS, build_config


@dataclass(frozen=True)
class LoadedJob:
    """A validated job spec, the file it came from, and the profile of every site."""

    path: Path
    spec: JobSpec
    profiles: dict[str, SiteProfile]


def load_job(path: Path) -> LoadedJob:
    """Read and validate ``path`` and resolve its site profiles; errors are InvalidInput."""
    path = Path(path).resolve()
    doc = load_yaml(path, "job spec")
    spec = validate_doc(doc, JobSpec, "job spec")
    errors: list[str] = []
    profiles: dict[str, SiteProfile] = {}
    for i, site in enumerate(spec.sites):
        line = doc.line_of(("sites", i, "profile"))
        where = f"{path}:{line}: job spec field sites[{i}].profile"
        try:
            profiles[site.name] = find_profile(site.profile, path.parent, referrer=where)
        except InvalidInput as exc:
            errors.extend(exc.lines)
    if spec.model.preset not in PRESETS:
        line = doc.line_of(("model", "preset"))
        errors.append(
            f"{path}:{line}: job spec field model.preset: unknown preset {spec.model.preset!r}; "
            f"use one of {', '.join(sorted(PRESETS))}."
        )
    else:
        try:
            build_config(spec.model)
        except ValueError as exc:
            line = doc.line_of(("model", "overrides"))
            errors.append(f"{path}:{line}: job spec field model.overrides: {exc}; fix the key.")
    if errors:
        raise InvalidInput(errors[0], lines=errors)
    return LoadedJob(path=path, spec=spec, profiles=profiles)
