"""Load a job spec and the site profiles it names, with every error pointing at file and field."""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from pathlib import Path

from xffl.aggregator.exchange_spec import LORA_CONTEXT
from xffl.core.errors import InvalidInput
from xffl.core.validation import field_path, validate_doc
from xffl.core.yamlio import Loc, YamlDoc, load_yaml
from xffl.jobs.spec.checkpoint_check import check_round_checkpoints
from xffl.jobs.spec.groups_check import check_local_groups
from xffl.jobs.spec.peft_check import install_command, peft_installed
from xffl.jobs.spec.schema import JobSpec
from xffl.jobs.spec.tracking import resolve
from xffl.site_profiles.lookup import PLACEHOLDER, find_profile, unfilled
from xffl.site_profiles.schema import SiteProfile
from xffl.training.arch import (
    PRESETS,
    ModelConfig,
    apply_overrides,
    build_config,
    check_tensor_parallel,
    known_fields,
)
from xffl.training.config import TOKENIZER_FILES, matches_target


@dataclass(frozen=True)
class LoadedJob:
    """A validated job spec, the file it came from, and the profile of every site."""

    path: Path
    spec: JobSpec
    profiles: dict[str, SiteProfile]

    def site_profile(self, site: str) -> SiteProfile:
        """The profile ``site`` runs with: its profile plus the spec's ``slurm`` overrides."""
        spec = next(s for s in self.spec.sites if s.name == site)
        return self.profiles[site].with_slurm(spec.slurm)


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
            profile = find_profile(site["profile"], path.parent, where)
        except InvalidInput as exc:
            errors.extend(exc.lines)
            continue
        profiles[str(site.get("name"))] = profile
        errors.extend(unfilled(site["profile"], profile, path.parent, where))
    return profiles, errors


def _check_placeholders(path: Path) -> list[str]:
    """A template's ``YOUR_...`` value left in the job spec (outside comments), line by line."""
    return [f"{path}:{n}: job spec: {text.split('#')[0].strip()!r} still holds a template's "
            f"{PLACEHOLDER}... placeholder; fill it in."
            for n, text in enumerate(path.read_text().splitlines(), 1)
            if PLACEHOLDER in text.split("#")[0]]


def _at(doc: YamlDoc, path: Path, loc: Loc) -> str:
    """``FILE:LINE: job spec field FIELD`` for ``loc`` (just FILE when the line is unknown)."""
    line = doc.line_of(loc)
    return f"{path}:{line}: job spec field {field_path(loc)}" if line else (
        f"{path}: job spec field {field_path(loc)}")


def _check_model(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """The model preset (or init checkpoint) must be a causal LM transformers builds, its
    overrides real config fields of the family, its weights the config's shapes."""
    model = spec.model
    if model.init is None and model.preset not in PRESETS:
        close = difflib.get_close_matches(model.preset, list(PRESETS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else (
            f"use one of {', '.join(sorted(PRESETS))}.")
        return [f"{_at(doc, path, ('model', 'preset'))}: unknown preset "
                f"{model.preset!r}; {hint}"]
    try:
        base = build_config(model.model_copy(update={"overrides": {}}))
    except (ValueError, TypeError, AttributeError) as exc:
        return [f"{_at(doc, path, ('model', 'init'))}: cannot start from {model.init!r} "
                f"({str(exc).rstrip('.')}); point init at a Hugging Face causal LM "
                "checkpoint folder (config.json and safetensors weights)."]
    known = known_fields(base) if model.overrides else []  # (transformers only when needed)
    for key in model.overrides:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}."
            return [f"{_at(doc, path, ('model', 'overrides', key))}: unknown model override "
                    f"{key!r}; {hint}"]
    try:
        config = apply_overrides(base, model.overrides)
    except ValueError as exc:
        return [f"{_at(doc, path, ('model', 'overrides'))}: {exc}; fix the value."]
    errors = [*_check_tensor_parallel(doc, spec, path, config),
              *_check_lora(doc, spec, path, config), *_check_tokenizer(doc, spec, path)]
    if not errors and model.init is not None and model.entry_point is None:
        mismatch = _check_init_weights(Path(model.init), base)
        if mismatch:
            return [f"{_at(doc, path, ('model', 'init'))}: {mismatch}; the weights must be "
                    "those of the folder's config.json (re-export the checkpoint)."]
    return errors


def _check_tokenizer(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """model.tokenizer must be a folder holding a tokenizer (what xffl export copies)."""
    folder = spec.model.tokenizer
    if folder is None or any((Path(folder) / n).is_file() for n in TOKENIZER_FILES):
        return []
    what = "holds no tokenizer.json or tokenizer_config.json" if Path(folder).is_dir() \
        else "is not a folder"
    return [f"{_at(doc, path, ('model', 'tokenizer'))}: {folder} {what}; point it at the "
            "model's tokenizer folder (the one `xffl data prepare --tokenizer` took)."]


def _check_init_weights(init: Path, config: ModelConfig) -> str | None:
    """What is wrong with ``init``'s weights for ``config`` (headers only), or None."""
    from xffl.aggregator.shards import open_model
    from xffl.core.errors import CheckpointError
    from xffl.training.model import needs_conversion
    from xffl.training.streamed import check_init, expected_tensors

    try:
        if needs_conversion(init, config):  # transformers converts (and checks) it at render
            return None
        with open_model(init) as reader:
            check_init(reader, expected_tensors(config, None))
    except CheckpointError as exc:
        return exc.message.rstrip(".")
    except ValueError as exc:
        return str(exc).rstrip(".")
    return None


def _check_lora(doc: YamlDoc, spec: JobSpec, path: Path, config: ModelConfig) -> list[str]:
    """LoRA's targets must exist in the model; LoRA options need training.lora."""
    lora = spec.training.lora
    if lora is None:
        if spec.aggregation.lora is not None:
            return [f"{_at(doc, path, ('aggregation', 'lora'))}: applies to LoRA adapters, "
                    "but the job trains the whole model; add training.lora or remove "
                    "aggregation.lora."]
        return []
    errors = []
    if not peft_installed():
        errors.append(f"{_at(doc, path, ('training', 'lora'))}: a LoRA job needs the peft "
                      f"package, which this Python ({sys.executable}) cannot import; install "
                      f"it: `{install_command(sys.executable)}`.")
    if spec.exchange.update == "delta":
        errors.append(f"{_at(doc, path, ('exchange', 'update'))}: a LoRA job sends its "
                      "adapter, which is already small; use exchange.update: weights "
                      "(`exchange: {update: weights, dtype: bf16}` halves it).")
    if spec.model.entry_point is None:  # a model of the user's own is checked when built
        from xffl.training.model import linear_modules

        linears = linear_modules(config)
        for i, target in enumerate(lora.target_modules):
            if not any(matches_target(m, target) for m in linears):
                names = sorted({m.rsplit(".", 1)[-1] for m in linears})
                errors.append(
                    f"{_at(doc, path, ('training', 'lora', 'target_modules', i))}: "
                    f"{target!r} matches no linear layer of the model; its linear layers "
                    f"are {', '.join(names)}.")
        if config.tie_word_embeddings and lora.matches("lm_head"):
            errors.append(f"{_at(doc, path, ('training', 'lora', 'target_modules'))}: "
                          "lm_head shares its weight with the embeddings in this model "
                          "(tie_word_embeddings); leave lm_head out of target_modules.")
    return errors


def _check_slurm_overrides(doc: YamlDoc, spec: JobSpec, path: Path,
                           profiles: dict[str, SiteProfile]) -> list[str]:
    """A site may override SLURM fields only when its profile runs on SLURM."""
    errors = []
    for i, site in enumerate(spec.sites):
        profile = profiles.get(site.name)
        if profile is None or site.slurm is None or profile.slurm is not None:
            continue
        errors.append(
            f"{_at(doc, path, ('sites', i, 'slurm'))}: site {site.name!r} overrides SLURM "
            f"settings, but its profile {profile.name!r} has no slurm section (it runs "
            f"{'locally' if profile.connector.type == 'local' else 'on the login node'}, "
            "without a batch job); remove the slurm key or use a SLURM profile."
        )
    return errors


def _check_tensor_parallel(doc: YamlDoc, spec: JobSpec, path: Path,
                           config: ModelConfig) -> list[str]:
    """tensor_parallel must divide the model's heads and MLP width and every site's ranks."""
    tp = spec.training.tensor_parallel
    try:
        check_tensor_parallel(config, tp)
    except InvalidInput as exc:
        return [f"{_at(doc, path, ('training', 'tensor_parallel'))}: {exc.message}"]
    errors = []
    for i, site in enumerate(spec.sites):
        if site.ranks % tp:
            errors.append(
                f"{_at(doc, path, ('sites', i, 'ranks'))}: {site.ranks} ranks cannot be split "
                f"into tensor-parallel groups of {tp}; use a multiple of {tp}."
            )
    return errors


def _check_shard_group(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """HSDP: every site has 2 or more data-parallel ranks, and a shard group (shard_group x
    tensor_parallel ranks) divides them (not larger)."""
    shard = spec.training.shard_group
    tp = spec.training.tensor_parallel
    if spec.training.data_parallel != "hsdp" or shard is None:
        return []
    group = shard * tp
    what = f"shard_group {shard}" + (f" x tensor_parallel {tp} = {group} ranks" if tp > 1
                                     else "")
    errors = []
    for i, site in enumerate(spec.sites):
        if tp > 1 and site.ranks % tp:
            continue  # the tensor-parallel check names it
        if site.ranks // tp < 2:
            errors.append(
                f"{_at(doc, path, ('sites', i, 'ranks'))}: site {site.name!r} has 1 rank"
                + (f" per tensor-parallel group ({site.ranks} ranks, tensor_parallel {tp})"
                   if tp > 1 else "") + ", and data_parallel hsdp needs 2 or more (it shards "
                "within groups and replicates across them); give it more ranks or use "
                "data_parallel: auto.")
        elif group > site.ranks:
            errors.append(
                f"{_at(doc, path, ('training', 'shard_group'))}: {what} is larger than site "
                f"{site.name!r} ({site.ranks} ranks); use a divisor of {site.ranks // tp}.")
        elif site.ranks % group:
            errors.append(
                f"{_at(doc, path, ('training', 'shard_group'))}: {what} does not divide the "
                f"ranks of site {site.name!r} ({site.ranks}); use a divisor of "
                f"{site.ranks // tp}.")
    return errors


def _check_deadline(doc: YamlDoc, spec: JobSpec, path: Path) -> list[str]:
    """A round deadline must leave every site time beyond its start-up to train."""
    deadline = spec.round_deadline
    if deadline is None:
        return []
    errors = []
    for i, site in enumerate(spec.sites):
        startup = site.startup if site.startup is not None else deadline.startup
        if startup < deadline.seconds:
            continue
        loc: tuple[str | int, ...] = ("sites", i, "startup") if site.startup is not None \
            else ("round_deadline", "seconds")
        errors.append(
            f"{_at(doc, path, loc)}: the round deadline of {deadline.seconds:g} s is not longer "
            f"than the start-up of site {site.name!r} ({startup:g} s), so no step could be "
            f"expected by it; raise round_deadline.seconds above {startup:g}.")
    return errors


def _is_lora(doc: YamlDoc) -> bool:
    """Whether the raw document asks for a LoRA job (training.lora), before validation: the
    exchange's own checks word their fixes for it."""
    training = doc.data.get("training") if isinstance(doc.data, dict) else None
    return isinstance(training, dict) and training.get("lora") is not None


def load_job(path: Path) -> LoadedJob:
    """Read and validate ``path`` and resolve its site profiles; errors are InvalidInput.

    All problems found are reported together, one line each, schema errors first.
    """
    path = Path(path).resolve()
    doc = load_yaml(path, "job spec")
    errors: list[str] = []
    spec: JobSpec | None = None
    try:
        spec = validate_doc(doc, JobSpec, "job spec", context={LORA_CONTEXT: _is_lora(doc)})
    except InvalidInput as exc:
        errors.extend(exc.lines)
    errors.extend(_check_placeholders(path))
    profiles, profile_errors = _check_profiles(doc, path)
    errors.extend(profile_errors)
    if spec is not None:  # model.init and model.tokenizer: where the job file is
        where = {k: str((path.parent / v).resolve()) for k in ("init", "tokenizer")
                 if (v := getattr(spec.model, k)) is not None}
        spec = spec.model_copy(update={"model": spec.model.model_copy(update=where)})
    if spec is not None:
        errors.extend(_check_model(doc, spec, path))
        errors.extend(_check_slurm_overrides(doc, spec, path, profiles))
        errors.extend(_check_deadline(doc, spec, path))
        errors.extend(_check_shard_group(doc, spec, path))
        errors.extend(check_local_groups(doc, spec, path))
        errors.extend(check_round_checkpoints(doc, spec, path, profiles))
    if errors or spec is None:
        raise InvalidInput(errors[0], lines=errors)
    if spec.tracking is not None:  # where the job file is, not where xffl runs
        spec = spec.model_copy(update={"tracking": resolve(spec.tracking, path.parent)})
    return LoadedJob(path=path, spec=spec, profiles=profiles)
