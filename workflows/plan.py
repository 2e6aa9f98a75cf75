"""Compile a JobSpec and its site profiles into the run directory's plan (CWL + StreamFlow).

The plan: ``main.cwl`` loops (cwltool:Loop, no JavaScript) over ``round.cwl``, in which every
site's train step runs in parallel and the aggregate step on the coordinator folds their
updates into the next global model and returns ``go`` for the next iteration.
``streamflow.yml`` binds each train step to its site's deployment. CWL and YAML are emitted
from Python data (never string templates), and names are restricted by the schemas, so no
user value can inject into a CWL id, a path or a shell line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xffl.core.names import slurm_job_name
from xffl.jobs.load import LoadedJob
from xffl.jobs.spec import AggregationSpec
from xffl.site_profiles.schema import SiteProfile
from xffl.training.config import TrainJob
from xffl.workflows.deployments import (
    sbatch_script,
    site_deployments,
    site_python,
    site_workdir,
)

LOOP_NS = "http://commonwl.org/cwltool#"
CWL_VERSION = "v1.2"


@dataclass(frozen=True)
class PlanPaths:
    """Where the pieces of a plan live inside its directory."""

    root: Path

    @property
    def main(self) -> Path:
        """The top-level looping workflow."""
        return self.root / "main.cwl"

    @property
    def inputs(self) -> Path:
        """The workflow inputs (job order)."""
        return self.root / "inputs.yml"

    @property
    def streamflow(self) -> Path:
        """The StreamFlow configuration file."""
        return self.root / "streamflow.yml"

    @property
    def initial_model(self) -> Path:
        """The round-0 global checkpoint the loop starts from."""
        return self.root / "rounds" / "0" / "global"


def site_data_path(profile: SiteProfile, site: str, path: str) -> str:
    """A site's data path on that site's filesystem (relative paths join the workdir)."""
    if path.startswith(("/", "~")):
        return path
    return f"{site_workdir(profile, site).rstrip('/')}/{path}"


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))


def train_tool(site: str, profile: SiteProfile, ranks: int, data_path: str,
               run_id: str | None = None) -> dict[str, Any]:
    """The CommandLineTool that trains one round at ``site`` and outputs ``update/``.

    At a SLURM site the launcher gets the round's job name (``--slurm-job-name``): it renames
    a job submitted under another name and records the job in ``update/slurm_job.json``.
    """
    env = {"PYTHONUNBUFFERED": "1", **profile.env}
    own = ["--ranks", str(ranks), "--launcher", profile.launcher]
    if profile.slurm is not None and run_id is not None:
        own += ["--slurm-job-name", slurm_job_name(run_id, site, "$(inputs.round)")]
    return {
        "cwlVersion": CWL_VERSION,
        "class": "CommandLineTool",
        "doc": f"Train one round at site {site} and write update/ (safetensors + manifest).",
        "requirements": {"EnvVarRequirement": {"envDef": env}},
        "baseCommand": [site_python(profile), "-m", "xffl.training.launch"],
        "arguments": [
            *own, "--",
            "--job", "$(inputs.job.path)", "--round", "$(inputs.round)",
            "--model", "$(inputs.model.path)", "--data", data_path, "--out", "update",
        ],
        "inputs": {"round": "int", "model": "Directory", "job": "File"},
        "outputs": {"update": {"type": "Directory", "outputBinding": {"glob": "update"}}},
    }


def aggregate_tool(run_id: str, run_dir: Path, registry: Path,
                   aggregation: AggregationSpec) -> dict[str, Any]:
    """The CommandLineTool that aggregates a round on the coordinator."""
    params = [f"--param={k}={v!r}" for k, v in sorted(aggregation.params.items())]
    if aggregation.max_shard_size is not None:
        params.append(f"--max-shard-size={aggregation.max_shard_size}")
    return {
        "cwlVersion": CWL_VERSION,
        "class": "CommandLineTool",
        "doc": "Verify the site updates, aggregate them into rounds/<r>/global, decide on the "
        "next round (cwl.output.json: model, next_round, go).",
        "baseCommand": [sys.executable, "-m", "xffl.workflows.aggregate_step"],
        "arguments": [
            "--run-id", run_id, "--run-dir", str(run_dir), "--registry", str(registry),
            "--weighting", aggregation.weighting, "--strategy", aggregation.strategy, *params,
        ],
        "inputs": {
            "round": {"type": "int", "inputBinding": {"prefix": "--round"}},
            "max_rounds": {"type": "int", "inputBinding": {"prefix": "--max-rounds"}},
            "model": {"type": "Directory", "inputBinding": {"prefix": "--previous"}},
            "updates": {"type": "Directory[]", "inputBinding": {"position": 1}},
        },
        "outputs": {"model": "Directory", "next_round": "int", "go": "boolean"},
    }


def round_workflow(sites: list[str]) -> dict[str, Any]:
    """One round: every site's train step in parallel, then the aggregate step."""
    steps: dict[str, Any] = {}
    for site in sites:
        steps[f"train_{site}"] = {
            "run": f"tools/train_{site}.cwl",
            "in": {"round": "round", "model": "model", "job": f"job_{site}"},
            "out": ["update"],
        }
    steps["aggregate"] = {
        "run": "tools/aggregate.cwl",
        "in": {
            "round": "round", "max_rounds": "max_rounds", "model": "model",
            "updates": {"source": [f"train_{s}/update" for s in sites],
                        "linkMerge": "merge_flattened"},
        },
        "out": ["model", "next_round", "go"],
    }
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": "One federated round: train at every site, aggregate on the coordinator.",
        "requirements": {"MultipleInputFeatureRequirement": {}},
        "inputs": {"round": "int", "go": "boolean", "max_rounds": "int", "model": "Directory",
                   **{f"job_{s}": "File" for s in sites}},
        "outputs": {
            "model": {"type": "Directory", "outputSource": "aggregate/model"},
            "next_round": {"type": "int", "outputSource": "aggregate/next_round"},
            "go": {"type": "boolean", "outputSource": "aggregate/go"},
        },
        "steps": steps,
    }


def main_workflow(sites: list[str]) -> dict[str, Any]:
    """The cyclic workflow: loop over round.cwl while the aggregate step says ``go``."""
    return {
        "cwlVersion": CWL_VERSION,
        "class": "Workflow",
        "doc": "Federated training: rounds of round.cwl until the aggregator stops the loop.",
        "$namespaces": {"cwltool": LOOP_NS},
        "requirements": {"SubworkflowFeatureRequirement": {}},
        "inputs": {"first_round": "int", "max_rounds": "int", "model": "Directory",
                   **{f"job_{s}": "File" for s in sites}},
        "outputs": {"rounds_done": {"type": "int", "outputSource": "rounds/next_round"}},
        "steps": {
            "rounds": {
                "run": "round.cwl",
                "in": {"round": "first_round", "go": {"default": True},
                       "max_rounds": "max_rounds", "model": "model",
                       **{f"job_{s}": f"job_{s}" for s in sites}},
                "out": ["model", "next_round", "go"],
                "requirements": {
                    "cwltool:Loop": {
                        "loopWhen": "$(inputs.go)",
                        "loop": {"round": "next_round", "model": "model", "go": "go"},
                        "outputMethod": "last",
                    }
                },
            }
        },
    }


def streamflow_config(run_id: str, loaded: LoadedJob, out: Path, run_dir: Path) -> dict[str, Any]:
    """streamflow.yml: the deployments of every site, the train steps bound to them."""
    deployments: dict[str, Any] = {}
    bindings = []
    for site in loaded.spec.sites:
        deps, target = site_deployments(run_id, site.name, loaded.site_profile(site.name),
                                        site.ranks, out, run_dir)
        deployments.update(deps)
        bindings.append({"step": f"/rounds/train_{site.name}", "target": target})
    return {
        "version": "v1.0",
        "workflows": {
            run_id: {"type": "cwl",
                     "config": {"file": "main.cwl", "settings": "inputs.yml"},
                     "bindings": bindings},
        },
        "deployments": deployments,
        "database": {"type": "default",
                     "config": {"connection": str(run_dir / "streamflow" / "sqlite.db")}},
    }


def write_plan(loaded: LoadedJob, run_id: str, out: Path, registry: Path,
               run_dir: Path | None = None, first_round: int = 1) -> PlanPaths:
    """Write the complete plan for ``loaded`` into ``out`` and return its paths.

    ``run_dir`` is where the plan will finally live (when ``out`` is a staging folder);
    absolute paths inside the plan point there. Paths in inputs.yml are relative to it.
    """
    out = Path(out).resolve()
    final = Path(run_dir).resolve() if run_dir is not None else out
    paths = PlanPaths(out)
    spec = loaded.spec
    names = [s.name for s in spec.sites]
    for site in spec.sites:
        profile = loaded.site_profile(site.name)
        data_path = site_data_path(profile, site.name, site.data.path)
        training = site.budget.apply(spec.training) if site.budget else spec.training
        job = TrainJob(run_id=run_id, site=site.name, rounds=spec.rounds, model=spec.model,
                       training=training, data=site.data)
        job_file = out / "jobs" / f"{site.name}.json"
        job_file.parent.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job.model_dump(mode="json"), indent=2) + "\n")
        _dump(out / "tools" / f"train_{site.name}.cwl",
              train_tool(site.name, profile, site.ranks, data_path, run_id))
        if profile.slurm is not None:
            script = out / "sbatch" / f"{site.name}.sh"
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(sbatch_script(run_id, site.name, profile, site.ranks, data_path,
                                            final))
            script.chmod(0o755)
    _dump(out / "tools" / "aggregate.cwl",
          aggregate_tool(run_id, final, registry, spec.aggregation))
    _dump(out / "round.cwl", round_workflow(names))
    _dump(paths.main, main_workflow(names))
    inputs: dict[str, Any] = {
        "first_round": first_round,
        "max_rounds": spec.rounds,
        "model": {"class": "Directory", "path": "rounds/0/global"},
    }
    for name in names:
        inputs[f"job_{name}"] = {"class": "File", "path": f"jobs/{name}.json"}
    _dump(paths.inputs, inputs)
    config = streamflow_config(run_id, loaded, out, final)
    _dump(paths.streamflow, config)
    from xffl.workflows.site_plan import write_site_plan  # it imports this module

    write_site_plan(out, run_id, config, names)
    # the resolved site profiles (the spec's slurm overrides applied), for `xffl status/cancel/
    # logs` to reach the sites (no secrets: key_file is a path)
    (out / "profiles.json").write_text(json.dumps(
        {s.name: loaded.site_profile(s.name).model_dump(mode="json") for s in spec.sites},
        indent=2) + "\n")
    return paths
