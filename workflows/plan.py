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
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xffl.core.paths import xffl_home
from xffl.jobs.load import LoadedJob
from xffl.jobs.spec import AggregationSpec
from xffl.site_profiles.schema import LocalConnector, SiteProfile
from xffl.training.config import TrainJob

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


def site_workdir(profile: SiteProfile, site: str) -> str:
    """The profile's working directory for ``site`` with placeholders substituted."""
    return profile.workdir.replace("{xffl_home}", str(xffl_home())).replace("{site}", site)


def site_data_path(profile: SiteProfile, site: str, path: str) -> str:
    """A site's data path on that site's filesystem (relative paths join the workdir)."""
    if path.startswith(("/", "~")):
        return path
    return f"{site_workdir(profile, site).rstrip('/')}/{path}"


def _python(profile: SiteProfile) -> str:
    return profile.python or sys.executable


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))


def train_tool(site: str, profile: SiteProfile, ranks: int, data_path: str) -> dict[str, Any]:
    """The CommandLineTool that trains one round at ``site`` and outputs ``update/``."""
    env = {"PYTHONUNBUFFERED": "1", **profile.env}
    return {
        "cwlVersion": CWL_VERSION,
        "class": "CommandLineTool",
        "doc": f"Train one round at site {site} and write update/ (safetensors + manifest).",
        "requirements": {"EnvVarRequirement": {"envDef": env}},
        "baseCommand": [_python(profile), "-m", "xffl.training.launch"],
        "arguments": [
            "--ranks", str(ranks), "--launcher", profile.launcher, "--",
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


def batch_template(profile: SiteProfile) -> str:
    """The batch script StreamFlow submits for a SLURM site (a Jinja2 template for it).

    ``{{streamflow_command}}`` is where StreamFlow puts the step's command; the setup lines
    and environment come from the site profile, shell-quoted.
    """
    lines = ["#!/bin/bash", "# xffl: one federated round at this site (submitted by StreamFlow)",
             "set -eo pipefail"]
    lines += list(profile.setup)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(profile.env.items())]
    lines += ["{{streamflow_command}}", ""]
    return "\n".join(lines)


def sbatch_script(run_id: str, site: str, profile: SiteProfile, ranks: int, data_path: str,
                  final: Path) -> str:
    """A complete batch script for one round at ``site``, runnable by hand with sbatch."""
    import jinja2

    slurm = profile.slurm
    assert slurm is not None
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("xffl.workflows", "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    flags = {"--partition": slurm.partition, "--account": slurm.account, "--qos": slurm.qos,
             "--ntasks-per-node": slurm.ntasks_per_node, "--gpus-per-node": slurm.gpus_per_node,
             "--cpus-per-task": slurm.cpus_per_task, "--mem": slurm.mem,
             "--constraint": slurm.constraint}
    options = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(slurm.extra)
    return env.get_template("sbatch.sh.j2").render(
        site=site, run_id=run_id, script_name=f"sbatch/{site}.sh",
        job_name=f"xffl-{run_id}-{site}", slurm=slurm, ranks=ranks, options=options,
        model=str(final / "rounds" / "0" / "global"), out=str(final / "manual" / site),
        setup=profile.setup, env=sorted(profile.env.items()), python=_python(profile),
        launcher=profile.launcher, job_file=str(final / "jobs" / f"{site}.json"),
        data=data_path,
    )


def slurm_service(run_id: str, site: str, profile: SiteProfile, ranks: int,
                  template: Path) -> dict[str, Any]:
    """sbatch options (StreamFlow's camelCase names) for a site's train job."""
    slurm = profile.slurm
    assert slurm is not None
    service: dict[str, Any] = {"file": str(template), "jobName": f"xffl-{run_id}-{site}",
                               "nodes": str(slurm.nodes), "ntasks": ranks, "time": slurm.time}
    optional = {"partition": slurm.partition, "account": slurm.account, "qos": slurm.qos,
                "ntasksPerNode": slurm.ntasks_per_node, "gpusPerNode": slurm.gpus_per_node,
                "cpusPerTask": slurm.cpus_per_task, "mem": slurm.mem,
                "constraint": slurm.constraint}
    service.update({k: v for k, v in optional.items() if v is not None})
    return service


def site_deployments(run_id: str, site: str, profile: SiteProfile, ranks: int,
                     out: Path, final: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The StreamFlow deployments of one site and the binding target of its train step."""
    conn = profile.connector
    if isinstance(conn, LocalConnector):
        return {f"site-{site}": {"type": "local", "config": {}}}, {"deployment": f"site-{site}"}
    login: dict[str, Any] = {"nodes": [f"{conn.host}:{conn.port}"], "checkHostKey": True}
    if conn.user:
        login["username"] = conn.user
    if conn.key_file:
        login["sshKey"] = conn.key_file
    workdir = site_workdir(profile, site)
    deployments: dict[str, Any] = {
        f"login-{site}": {"type": "ssh", "config": login, "workdir": workdir},
    }
    if profile.slurm is None:
        return deployments, {"deployment": f"login-{site}"}
    template = out / "sbatch" / f"{site}.j2"
    template.parent.mkdir(parents=True, exist_ok=True)
    template.write_text(batch_template(profile))
    deployments[f"slurm-{site}"] = {
        "type": "slurm", "wraps": f"login-{site}", "workdir": workdir,
        "config": {
            "pollingInterval": profile.slurm.polling_interval, "maxConcurrentJobs": 4,
            "services": {"train": slurm_service(run_id, site, profile, ranks,
                                                final / "sbatch" / f"{site}.j2")},
        },
    }
    return deployments, {"deployment": f"slurm-{site}", "service": "train"}


def streamflow_config(run_id: str, loaded: LoadedJob, out: Path, run_dir: Path) -> dict[str, Any]:
    """streamflow.yml: the deployments of every site, the train steps bound to them."""
    deployments: dict[str, Any] = {}
    bindings = []
    for site in loaded.spec.sites:
        deps, target = site_deployments(run_id, site.name, loaded.profiles[site.name],
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
        profile = loaded.profiles[site.name]
        data_path = site_data_path(profile, site.name, site.data.path)
        job = TrainJob(run_id=run_id, site=site.name, rounds=spec.rounds, model=spec.model,
                       training=spec.training,
                       data=site.data)
        job_file = out / "jobs" / f"{site.name}.json"
        job_file.parent.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job.model_dump(mode="json"), indent=2) + "\n")
        _dump(out / "tools" / f"train_{site.name}.cwl",
              train_tool(site.name, profile, site.ranks, data_path))
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
    _dump(paths.streamflow, streamflow_config(run_id, loaded, out, final))
    # the resolved site profiles, for `xffl status/cancel/logs` to reach the sites (no secrets:
    # key_file is a path)
    (out / "profiles.json").write_text(json.dumps(
        {s.name: loaded.profiles[s.name].model_dump(mode="json") for s in spec.sites},
        indent=2) + "\n")
    return paths
