"""Load a job spec and the site profiles it names, with every error pointing at file and field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.validation import validate_doc
from xffl.core.yamlio import YamlDoc, load_yaml
from xffl.jobs.spec import JobSpec
from xffl.site_profiles.lookup import find_profile
from xffl.site_profiles.schema import SiteProfile
from xffl.training.arch import check_tensor_parallel
from xffl.training.model import PRESETS, LlamaConfig, build_config


@dataclass(frozen=True)
class LoadedJob:
    """A validated job spec, the file it came from, and the profile of every site."""

    path: Path
    spec: JobSpec
    profiles: dict[str, SiteProfile]


def _check_profiles(doc: YamlDoc, path: Path) -> tuple[dict[str, SiteProfile], list[str]]:
    """Resolve the profile of every site in the raw document (even if other fields are bad)."""
    profiles: dict[str, SiteProfile] = {}
    errors: list[str] = []
    sites = doc.data.get("sites")
    for i, site in enumerate(sites if isinstance(sites, list) else []):
        if not isinstance(site, dict) or not isinstance(site.get("profile"), str):
            continue
        line = doc.line_of(("sites", i, "profile"))
        where = f"{path}:{line}: job spec field sites[{i}].profile"
        try:
            profiles[str(site.get("name"))] = find_profile(site["profile"], path.parent, where)
        except InvalidInput as exc:
            errors.extend(exc.lines)
    return profiles, errors


def _check_model(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """The model preset must exist and its overrides must name real config fields."""
    if spec.model.preset not in PRESETS:
        line = doc.line_of(("model", "preset"))
        return [f"{path}:{line}: job spec field model.preset: unknown preset "
                f"{spec.model.preset!r}; use one of {', '.join(sorted(PRESETS))}."]
    try:
        config = build_config(spec.model)
    except ValueError as exc:
        line = doc.line_of(("model", "overrides"))
        return [f"{path}:{line}: job spec field model.overrides: {exc}; fix the key."]
    return _check_tensor_parallel(doc, spec, path, config)


def _check_tensor_parallel(doc: YamlDoc, spec: JobSpec, path: Path,
                           config: LlamaConfig) -> list[str]:
    """tensor_parallel must divide the model's heads and MLP width and every site's ranks."""
    tp = spec.training.tensor_parallel
    line = doc.line_of(("training", "tensor_parallel"))
    try:
        check_tensor_parallel(config, tp)
    except InvalidInput as exc:
        return [f"{path}:{line}: job spec field training.tensor_parallel: {exc.message}"]
    errors = []
    for i, site in enumerate(spec.sites):
        if site.ranks % tp:
            errors.append(
                f"{path}:{doc.line_of(('sites', i, 'ranks'))}: job spec field "
                f"sites[{i}].ranks: {site.ranks} ranks cannot be split into tensor-parallel "
                f"groups of {tp}; use a multiple of {tp}."
            )
    return errors


def load_job(path: Path) -> LoadedJob:
    """Read and validate ``path`` and resolve its site profiles; errors are InvalidInput.

    All problems found are reported together, one line each, schema errors first.
    """
    path = Path(path).resolve()
    doc = load_yaml(path, "job spec")
    errors: list[str] = []
    spec: JobSpec | None = None
    try:
        spec = validate_doc(doc, JobSpec, "job spec")
    except InvalidInput as exc:
        errors.extend(exc.lines)
    profiles, profile_errors = _check_profiles(doc, path)
    errors.extend(profile_errors)
    if spec is not None:
        errors.extend(_check_model(doc, spec, path))
    if errors or spec is None:
        raise InvalidInput(errors[0], lines=errors)
    return LoadedJob(path=path, spec=spec, profiles=profiles)
