"""Each site's evaluation tool (``tools/evaluate_<site>.cwl``), one source for the two plans
that run it: ``xffl evaluate``'s workflow (:mod:`xffl.workflows.plan.evaluation`) and
main.cwl's evaluation of the final model (:mod:`xffl.workflows.plan.compile`)."""

from __future__ import annotations

import math
from typing import Any

import yaml

from xffl.core.layout import RunLayout
from xffl.core.names import slurm_job_name
from xffl.jobs.report.numbers import GLOBAL  # the round's global model, beside the updates
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.schema import SiteProfile
from xffl.training.launch import EVALUATE_MODULE
from xffl.workflows.plan.cwl import CWL_VERSION
from xffl.workflows.plan.deployments import SLURM_NAME_OPTION, site_data_path, site_python


def evaluate_step(site: str) -> str:
    """The id of a site's step in evaluate.cwl (and its StreamFlow step name, with a /)."""
    return f"evaluate_{site}"


def result_name(site: str) -> str:
    """The file a site's evaluation writes and sends back."""
    return f"evaluation-{site}.json"


def eval_job_name(run_id: str, site: str, rnd: int | str) -> str:
    """The SLURM job name of ``site``'s evaluation of round ``rnd``: ``<prefix>.eval-r<rnd>``.

    A dot cannot be in a site name, so no site's training job (``<prefix>-r<rnd>``) is
    ever mistaken for it, nor it for one.
    """
    return f"{slurm_job_name(run_id, site)}.eval-r{rnd}"


def evaluate_tool(*, run_id: str, site: str, sites: list[str], python: str, launcher: str,
                  ranks: int, data: str, env: dict[str, str], slurm: bool,
                  time_limit: float | None) -> dict[str, Any]:
    """The CommandLineTool that evaluates the models it is given at ``site``.

    The launcher's own options come first (position 0), the module's after ``--``
    (position 1, in any order); an update that is absent (null) adds no ``--model``.
    """
    own = ["--ranks", str(ranks), "--launcher", launcher, "--module", EVALUATE_MODULE]
    if slurm:
        own += [SLURM_NAME_OPTION, eval_job_name(run_id, site, "$(inputs.round)")]
    after = ["--data", data, "--out", result_name(site)]
    requirements: dict[str, Any] = {
        "EnvVarRequirement": {"envDef": {"PYTHONUNBUFFERED": "1", **env}}}
    if time_limit is not None:
        requirements["ToolTimeLimit"] = {"timelimit": math.ceil(time_limit)}

    def model(name: str, kind: str) -> dict[str, Any]:
        return {"type": kind, "inputBinding": {"prefix": f"--model={name}=", "separate": False,
                                               "position": 1}}
    return {
        "cwlVersion": CWL_VERSION,
        "class": "CommandLineTool",
        "doc": f"Evaluate a round's models on site {site}'s held-out data; write "
        f"{result_name(site)} (numbers only).",
        "requirements": requirements,
        "baseCommand": [python, "-m", "xffl.training.launch"],
        "arguments": [*own, "--", *({"valueFrom": a, "position": 1} for a in after)],
        "inputs": {
            "round": "int",
            "job": {"type": "File", "inputBinding": {"prefix": "--job", "position": 1}},
            f"model_{GLOBAL}": model(GLOBAL, "Directory"),
            **{f"update_{s}": model(s, "Directory?") for s in sites},
        },
        "outputs": {"evaluation": {"type": "File",
                                   "outputBinding": {"glob": result_name(site)}}},
    }


def write_evaluate_tools(layout: RunLayout, run_id: str, spec: JobSpec,
                         profiles: dict[str, SiteProfile], envs: dict[str, dict[str, str]]) -> None:
    """Write every site's ``tools/evaluate_<site>.cwl``: one source for ``xffl evaluate``'s
    workflow and main.cwl's evaluation of the final model (``envs``: each site's
    environment, as the plan gives it)."""
    sites = [s.name for s in spec.sites]
    for site in spec.sites:
        profile = profiles[site.name]
        path = layout.tool(evaluate_step(site.name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(evaluate_tool(
            run_id=run_id, site=site.name, sites=sites, python=site_python(profile),
            launcher=profile.launcher, ranks=site.ranks,
            data=site_data_path(profile, site.name, site.data.path), env=envs[site.name],
            slurm=profile.slurm is not None, time_limit=spec.failure.round_timeout),
            sort_keys=False, width=100))
