"""The user's consent to run a job spec's Python (``model.entry_point``) on the coordinator.

A job spec may come from someone else. The Python it names is imported on this machine only
where round 0 cannot be written without it (a seeded ``model.entry_point`` model, a LoRA
adapter over one; with ``model.init`` a whole model's round 0 is the init's tensors, copied
without the code), and only after the user said so with ``--trust-entry-point`` on ``xffl
render`` or ``xffl submit``. Submit records that consent in the run directory
(:data:`TRUST_FILE`, naming the entry point), where the run's supervisor (its first
execution, ``xffl resume``, a cron round) looks before it writes round 0. ``xffl simulate``
trains its virtual sites here, so any Python the spec names needs the flag there, and so does
``xffl submit`` of a job with a site on a ``local`` profile (its training runs here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from xffl.core.errors import InvalidInput
from xffl.core.files import write_json
from xffl.core.yamlio import load_yaml
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.schema import SiteProfile

#: the run directory's record of the user's consent (written by ``xffl submit``).
TRUST_FILE = "trusted-code.json"
#: the command-line flag that gives it.
FLAG = "--trust-entry-point"


def coordinator_code(spec: JobSpec) -> str | None:
    """The entry point the coordinator imports to write round 0, or None when it needs none."""
    model = spec.model
    if model.entry_point is None:
        return None
    if model.init is None or spec.training.lora is not None:
        return model.entry_point
    return None


def local_code(spec: JobSpec) -> list[tuple[tuple[str, str], str]]:
    """Every Python the spec names, as (field, value): what sites trained here import."""
    fields = ((("model", "entry_point"), spec.model.entry_point),
              (("training", "update_fn"), spec.training.update_fn))
    return [(loc, value) for loc, value in fields if value is not None]


def _where(job: Path, loc: tuple[str, str]) -> str:
    """``FILE:LINE: job spec field A.B`` (FILE alone when the line is unknown)."""
    line = load_yaml(job, "job spec").line_of(loc)
    return f"{job}:{line}" if line else str(job)


def require_consent(job: Path, spec: JobSpec, trusted: bool, command: str) -> None:
    """InvalidInput (exit 2) when writing round 0 would run the spec's Python here and the
    user did not pass :data:`FLAG`."""
    code = coordinator_code(spec)
    if code is None or trusted:
        return
    fix = ("a LoRA adapter over a model of your own needs its code to find the layers"
           if spec.training.lora is not None else
           "or set model.init to a checkpoint folder of the model's weights, which round 0 "
           "copies without running the code")
    raise InvalidInput(
        f"{_where(job, ('model', 'entry_point'))}: job spec field model.entry_point: "
        f"`xffl {command}` would import {code} and run it on this machine to write round 0; "
        f"read that code and pass {FLAG} if you trust it, {fix}.")


def require_local_consent(job: Path, spec: JobSpec, trusted: bool, command: str) -> None:
    """InvalidInput (exit 2) when the spec names Python that ``command`` runs on this machine
    (virtual sites train here) and the user did not pass :data:`FLAG`."""
    named = local_code(spec)
    if not named or trusted:
        return
    loc, value = named[0]
    raise InvalidInput(
        f"{_where(job, loc)}: job spec field {'.'.join(loc)}: `xffl {command}` would import "
        f"{value} and run it on this machine; read that code and pass {FLAG} if you trust "
        "it.")


def local_sites(spec: JobSpec, profiles: Mapping[str, SiteProfile]) -> list[str]:
    """The job's sites whose profile runs them on this machine (StreamFlow's local
    connector): their training imports the spec's Python here."""
    return [s.name for s in spec.sites if profiles[s.name].connector.type == "local"]


def require_site_consent(job: Path, spec: JobSpec, profiles: Mapping[str, SiteProfile],
                         trusted: bool, command: str) -> None:
    """InvalidInput (exit 2) when a site of the job trains on this machine (a ``local``
    profile), so its training would import the spec's Python (``training.update_fn``, or
    ``model.entry_point`` even with ``model.init``) here, and the user did not pass
    :data:`FLAG`."""
    named = local_code(spec)
    here = local_sites(spec, profiles)
    if not named or not here or trusted:
        return
    loc, value = named[0]
    raise InvalidInput(
        f"{_where(job, loc)}: job spec field {'.'.join(loc)}: site {here[0]} trains on this "
        f"machine (profile {profiles[here[0]].name}), so `xffl {command}` would import {value} "
        f"and run it here; read that code and pass {FLAG} if you trust it.")


def record_consent(run_dir: Path, spec: JobSpec) -> None:
    """Record in ``run_dir`` that the user allowed the spec's entry point on the coordinator."""
    write_json(run_dir / TRUST_FILE, {"model.entry_point": spec.model.entry_point})


def consented(run_dir: Path, spec: JobSpec) -> bool:
    """Whether ``run_dir`` records the user's consent to the spec's entry point."""
    try:
        record = json.loads((run_dir / TRUST_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and spec.model.entry_point is not None and \
        record.get("model.entry_point") == spec.model.entry_point


def check_round0(spec: JobSpec, trusted: bool) -> None:
    """InvalidInput unless round 0 can be written without the spec's Python or ``trusted``
    (the last guard, where round 0 is written: render and the supervisor)."""
    code = coordinator_code(spec)
    if code is not None and not trusted:
        raise InvalidInput(
            f"model.entry_point {code}: writing round 0 would run this Python on the "
            f"coordinator, and the user did not allow it; `xffl submit {FLAG}` (or `xffl "
            f"render {FLAG}`) allows it for one run, after reading the code.")
