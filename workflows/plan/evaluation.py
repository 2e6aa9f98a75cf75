"""The cross-site evaluation of a round, as files of the run directory (`xffl evaluate`).

``evaluate.cwl`` is one CWL Workflow with one step per site, ``evaluate_<site>``, running
``tools/evaluate_<site>.cwl`` at the site: the launcher starts
``xffl.training.evaluate_models`` with the site's ranks (torchrun, srun), which evaluates
every model it is given on the site's held-out sequences. The models are Directory inputs
(the round's global and every site's update kept in ``rounds/<r>/updates/<site>``, each
sent as :func:`sent_update` stages it: its tensor files with the global's config bytes, never
the site's own), so StreamFlow sends them to every site; each step's output is one small
JSON file of numbers (``evaluation-<site>.json``: the workflow's outputs are collected into
one folder, so each site's file has a name of its own). ``streamflow-evaluate.yml`` binds
each step to the deployment the site trains on (the plan's own, from
:func:`xffl.workflows.plan.compile.site_targets`) and ``executions/evaluate-r<r>.yml`` names a
round's models; ``streamflow run
streamflow-evaluate.yml`` runs the last evaluation written, as ``xffl evaluate`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xffl.aggregator.exchange import (
    MANIFEST_FILE,
    finalize_manifest,
    read_manifest,
    read_small_file,
    staged_dir,
)
from xffl.aggregator.inputs import own_config
from xffl.aggregator.shards import CONFIG_FILE
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.core.files import link_files
from xffl.core.layout import RunLayout
from xffl.jobs.report.numbers import GLOBAL  # the round's global model, beside the updates
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.schema import SiteProfile
from xffl.workflows.extensions import FAILURE_MANAGER
from xffl.workflows.plan.compile import report_bounds, site_envs, site_targets
from xffl.workflows.plan.cwl import CWL_VERSION
from xffl.workflows.plan.evaluate_tool import (
    evaluate_step,
    write_evaluate_tools,
)

WORKFLOW = "evaluate"  # the workflow's name in streamflow-evaluate.yml


def evaluate_workflow(sites: list[str]) -> dict[str, Any]:
    """evaluate.cwl: every site evaluates the global and every update it is given."""
    models = {f"model_{GLOBAL}": f"model_{GLOBAL}", **{f"update_{s}": f"update_{s}"
                                                       for s in sites}}
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": "Cross-site evaluation: every site evaluates a round's global model and every "
        "site's update on its own held-out data; only the numbers come back.",
        "inputs": {"round": "int", f"model_{GLOBAL}": "Directory",
                   **{f"update_{s}": "Directory?" for s in sites},
                   **{f"job_{s}": "File" for s in sites}},
        "outputs": {f"evaluation_{s}": {"type": "File?",
                                        "outputSource": f"{evaluate_step(s)}/evaluation"}
                    for s in sites},
        "steps": {evaluate_step(s): {"run": f"tools/{evaluate_step(s)}.cwl",
                                     "in": {"round": "round", "job": f"job_{s}", **models},
                                     "out": ["evaluation"]} for s in sites},
    }


def site_steps(site: str) -> list[str]:
    """The StreamFlow steps whose failure is the site's: its evaluation, the file's return."""
    return [f"/{evaluate_step(site)}", f"/evaluation_{site}-collector"]


def evaluate_config(spec: JobSpec, profiles: dict[str, SiteProfile], layout: RunLayout,
                    inputs: Path) -> dict[str, Any]:
    """streamflow-evaluate.yml: each site's step bound to the deployment it trains on.

    xffl's failure manager retries a site's evaluation as the job's policy says, then lets
    the others finish without it; the evaluations have a StreamFlow database of their own.
    """
    root = layout.root
    deployments, targets, _ = site_targets(profiles, root, root)
    return {
        "version": "v1.0",
        "workflows": {WORKFLOW: {
            "type": "cwl",
            "config": {"file": layout.evaluate_cwl.name,
                       "settings": str(inputs.relative_to(root))},
            "bindings": [{"step": f"/{evaluate_step(s)}", "target": target}
                         for s, target in targets.items()]}},
        "deployments": deployments,
        "failureManager": {"enabled": True, "type": FAILURE_MANAGER, "config": {
            "retries": spec.failure.retries, "retry_delay": spec.failure.retry_delay,
            "sites": {s.name: site_steps(s.name) for s in spec.sites}}},
        "database": {"type": "default", "config": {"connection": str(layout.evaluate_db)}},
    }


def check_evaluable(spec: JobSpec, final: bool = False) -> None:
    """InvalidInput unless every site can evaluate every update of the job as it is kept
    (``final``: the global model alone, as the final evaluation after the last round does)."""
    if spec.training.lora is not None:
        raise InvalidInput("this run trains a LoRA adapter (training.lora): its updates are "
                           "adapters, which xffl evaluate does not load; evaluate a whole-model "
                           "run.")
    if not final and spec.exchange.update == "delta":
        raise InvalidInput(f"this run's updates are deltas (exchange: {spec.exchange.label()}); "
                           "xffl evaluate needs whole weights (exchange.update: weights).")
    if not final and any(s.name == GLOBAL for s in spec.sites):
        raise InvalidInput(f"a site is named {GLOBAL!r}, the name of the global model's "
                           "column; xffl evaluate cannot tell them apart.")
    missing = [s.name for s in spec.sites if s.data.validation is None]
    if missing:
        raise InvalidInput(f"site(s) {', '.join(missing)} have no held-out data; add "
                           "data.validation ({fraction: 0.1} or {path: DIR}) to each in the job "
                           "spec (a run submitted from it evaluates every round).")


def sent_update(layout: RunLayout, rnd: int, site: str) -> Path:
    """Stage ``site``'s kept update of round ``rnd`` as the evaluation sends it; its folder.

    Its tensor files (linked) and the round's global config.json bytes (the coordinator's:
    a site's own bytes, equal to the global's as JSON but perhaps not loadable, never reach
    another site), with a manifest whose checksum is that config's. Nothing else the site
    sent (its SLURM record) is sent on. InvalidInput when the kept update is unreadable or
    its config is not the global's as a JSON value.
    """
    kept, glob = layout.kept_update(rnd, site), layout.global_dir(rnd)
    try:
        manifest = read_manifest(kept)
        config = own_config(glob)
        if config is None:
            raise CheckpointError(f"{glob} has no {CONFIG_FILE}")
        if CONFIG_FILE in manifest.files and json.loads(
                read_small_file(kept / CONFIG_FILE)) != json.loads(config):
            raise CheckpointError(f"its {CONFIG_FILE} is not the global model's")
    except (OSError, ValueError, CheckpointError) as exc:
        raise InvalidInput(f"{kept}: the kept update of site {site} cannot be sent "
                           f"({exc}); evaluate another round.") from exc
    tensors = sorted(n for n in manifest.files if n not in (CONFIG_FILE, MANIFEST_FILE))
    out = layout.evaluate_update(rnd, site)
    with staged_dir(out) as tmp:
        link_files(kept, tmp, tensors)
        (tmp / CONFIG_FILE).write_bytes(config)
        finalize_manifest(tmp, manifest, checksums={n: manifest.files[n] for n in tensors})
    return out


@dataclass(frozen=True)
class EvaluationPlan:
    """What one evaluation sends and expects: its round, models, sites and their budgets."""

    round: int
    models: list[str]  # "global" then the sites whose update the round kept
    sites: list[str]
    budgets: dict[str, int]  # the most held-out sequences each site may report
    config: Path
    inputs: Path
    seq_lens: dict[str, int]  # the targets one held-out sequence of each site holds


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))


def write_evaluation(layout: RunLayout, run_id: str, spec: JobSpec,
                     profiles: dict[str, SiteProfile], rnd: int,
                     final: bool = False) -> EvaluationPlan:
    """Write the evaluation workflow of round ``rnd`` into the run directory (``final``: of
    round ``rnd``'s global model alone, no update)."""
    check_evaluable(spec, final)
    if not layout.global_dir(rnd).is_dir():
        raise InvalidInput(f"run {run_id} has no global model after round {rnd}; "
                           "`xffl status` shows its completed rounds.")
    sites = [s.name for s in spec.sites]
    kept = [] if final else [s for s in sites if layout.kept_update(rnd, s).is_dir()]
    sent = {s: sent_update(layout, rnd, s) for s in kept}  # a refusal comes before the plan
    write_evaluate_tools(layout, run_id, spec, profiles, site_envs(spec, profiles))
    _dump(layout.evaluate_cwl, evaluate_workflow(sites))
    inputs = layout.evaluate_inputs(rnd)
    order: dict[str, Any] = {
        "round": rnd,
        f"model_{GLOBAL}": {"class": "Directory", "path": f"../rounds/{rnd}/{GLOBAL}"},
        **{f"update_{s}": {"class": "Directory",
                           "path": str(sent[s].relative_to(inputs.parent))} for s in kept},
        **{f"job_{s}": {"class": "File", "path": f"../jobs/{s}.json"} for s in sites},
    }
    _dump(inputs, order)
    _dump(layout.streamflow_evaluate, evaluate_config(spec, profiles, layout, inputs))
    bounds = {s.name: report_bounds(spec, s) for s in spec.sites}
    return EvaluationPlan(round=rnd, models=[GLOBAL, *kept], sites=sites,
                          budgets={s: b[2] or 0 for s, b in bounds.items()},
                          config=layout.streamflow_evaluate, inputs=inputs,
                          seq_lens={s: b[3] or 0 for s, b in bounds.items()})
