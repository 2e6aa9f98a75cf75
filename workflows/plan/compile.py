"""Compile a JobSpec and its site profiles into a plan directory (CWL + StreamFlow + scripts).

The plan is the truth: ``xffl render`` writes it, ``xffl submit`` writes the same files into
the run directory and runs ``main.cwl`` with StreamFlow, and ``streamflow run
streamflow.yml`` or ``cwltool --enable-ext main.cwl inputs.yml`` run it as written. CWL and
YAML are emitted from Python data (:mod:`xffl.workflows.plan.cwl`), never string templates; the
batch scripts come from one Jinja2 template (:func:`xffl.workflows.plan.deployments.batch_script`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from xffl.core.layout import RunLayout
from xffl.jobs.spec.checkpoint_check import signal_margin
from xffl.jobs.spec.deadline import RoundDeadline
from xffl.jobs.spec.load import LoadedJob
from xffl.jobs.spec.schema import JobSpec, SiteSpec
from xffl.site_profiles.schema import LocalConnector, SiteProfile
from xffl.training.config import DataSpec, TrainJob
from xffl.training.threads import LOCAL_RANKS_ENV
from xffl.workflows.extensions import DATA_MANAGER, FAILURE_MANAGER
from xffl.workflows.plan import cwl, init_cache
from xffl.workflows.plan.deployments import (
    COORDINATOR,
    batch_script,
    kept_updates_dir,
    queue_deployment,
    site_data_path,
    site_deployments,
    site_python,
)
from xffl.workflows.plan.evaluate_tool import write_evaluate_tools
from xffl.workflows.steps.bounds import report_bounds as report_bounds
from xffl.workflows.steps.final_validation import skipped


def _dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))


def adopting(spec: JobSpec) -> RoundDeadline | None:
    """The job's round deadline when late jobs are adopted (``late: adopt``), else None."""
    deadline = spec.round_deadline
    return deadline if deadline is not None and deadline.late == "adopt" else None


def train_time_limit(spec: JobSpec) -> float | None:
    """The train tool's time limit: the round deadline when late jobs are adopted (a job
    past it is left running), else ``failure.round_timeout`` (a job past it is cancelled)."""
    late = adopting(spec)
    return late.seconds if late is not None else spec.failure.round_timeout


def failure_manager(spec: JobSpec, run_dir: Path) -> dict[str, Any]:
    """streamflow.yml's ``failureManager``: xffl's site failure manager with the job's policy
    (the final model's evaluation, when the plan has it, as each site's too)."""
    config: dict[str, Any] = {
        "retries": spec.failure.retries, "retry_delay": spec.failure.retry_delay,
        "run_dir": str(run_dir), "sites": {s.name: cwl.site_steps(s.name) for s in spec.sites}}
    if skipped(spec) is None:
        config["final"] = {s.name: cwl.final_site_steps(s.name) for s in spec.sites}
    return {"enabled": True, "type": FAILURE_MANAGER, "config": config}


def site_targets(profiles: dict[str, SiteProfile], out: Path, final: Path) -> tuple[
        dict[str, Any], dict[str, dict[str, Any]], dict[str, str]]:
    """Every site's StreamFlow deployments, the binding target of the steps it runs (its
    training, its cross-site evaluation), and the site owning each deployment."""
    deployments: dict[str, Any] = {}
    targets: dict[str, dict[str, Any]] = {}
    owners: dict[str, str] = {}  # deployment -> site, for the transfer clock
    for site, profile in profiles.items():
        deps, targets[site] = site_deployments(site, profile, out, final)
        deployments.update(deps)
        owners.update(dict.fromkeys(deps, site))
    return deployments, targets, owners


def site_envs(spec: JobSpec, profiles: dict[str, SiteProfile]) -> dict[str, dict[str, str]]:
    """Each site's tool environment: its profile's, and for sites on the coordinator's
    machine how many ranks share its CPUs (they run at once)."""
    local = {s.name for s in spec.sites if isinstance(profiles[s.name].connector, LocalConnector)}
    local_ranks = sum(s.ranks for s in spec.sites if s.name in local)
    return {s.name: {LOCAL_RANKS_ENV: str(local_ranks), **profiles[s.name].env}
            if s.name in local else dict(profiles[s.name].env) for s in spec.sites}


def streamflow_config(run_id: str, loaded: LoadedJob, out: Path, final: Path) -> dict[str, Any]:
    """streamflow.yml: every site's deployments, train steps bound to them, the failure policy.

    The admit and aggregate steps run on the coordinator (the ``coordinator`` deployment).
    """
    layout = RunLayout(final)
    # the coordinator's steps run here, their folders inside the run directory (the same
    # filesystem as rounds/, so updates and globals are hard-linked, never copied); StreamFlow's
    # own local connector runs them in the supervisor's process group, which `xffl cancel` stops
    deployments: dict[str, Any] = {COORDINATOR: {
        "type": "local", "config": {}, "workdir": str(layout.coordinator_workdir)}}
    bindings: list[dict[str, Any]] = [
        {"step": cwl.step_path(step), "target": {"deployment": COORDINATOR}}
        for step in [*(cwl.admit_step(s.name) for s in loaded.spec.sites), "aggregate"]]
    sites, targets, owners = site_targets(
        {s.name: loaded.site_profile(s.name) for s in loaded.spec.sites}, out, final)
    deployments.update(sites)
    copy_limit = train_time_limit(loaded.spec)
    for site in loaded.spec.sites:  # no copy to or from a site outlasts a round's job
        login = deployments.get(f"login-{site.name}")
        if copy_limit is not None and login is not None:
            login["config"]["copyTimeout"] = copy_limit
    late = adopting(loaded.spec)
    for site in loaded.spec.sites:  # batch sites leave a late job running, then adopt it
        scheduler = loaded.site_profile(site.name).scheduler
        queue = None if scheduler is None else deployments.get(
            queue_deployment(scheduler, site.name))
        if queue is not None:  # a job an earlier supervisor left running is adopted too
            queue["config"]["inflight"] = {"runDir": str(final), "site": site.name}
        if late is not None and queue is not None:
            queue["config"]["late"] = {"runDir": str(final), "site": site.name,
                                       "maxRounds": late.staleness.max_rounds}
    bindings += [{"step": cwl.step_path(cwl.train_step(s)), "target": target}
                 for s, target in targets.items()]
    if skipped(loaded.spec) is None:  # the final evaluation: where each site trains
        bindings += [{"step": f"/{cwl.final_evaluate_step(s)}", "target": target}
                     for s, target in targets.items()]
        bindings.append({"step": f"/{cwl.FINAL_STEP}", "target": {"deployment": COORDINATOR}})
    return {
        "version": "v1.0",
        "workflows": {
            run_id: {"type": "cwl",
                     "config": {"file": layout.main.name, "settings": layout.inputs.name},
                     "bindings": bindings},
        },
        "deployments": deployments,
        "failureManager": failure_manager(loaded.spec, final),
        "dataManager": {"type": DATA_MANAGER, "config": {"run_dir": str(final), "sites": owners}},
        "database": {"type": "default", "config": {"connection": str(layout.streamflow_db)}},
    }


def loop_inputs(spec: JobSpec, first_round: int, last_round: int,
                base: str = "") -> dict[str, Any]:
    """main.cwl's job order: rounds ``first_round``..``last_round``, from the global before them.

    Paths are relative to the inputs file: ``base`` leads from its folder to the plan's root.
    """
    data: dict[str, Any] = {
        "first_round": first_round, "max_rounds": last_round,
        "model": {"class": "Directory", "path": f"{base}rounds/{first_round - 1}/global"},
    }
    if spec.training.lora is not None:  # the frozen base model of a LoRA job
        data["base"] = {"class": "Directory", "path": f"{base}rounds/0/base"}
    for site in spec.sites:
        data[f"job_{site.name}"] = {"class": "File", "path": f"{base}jobs/{site.name}.json"}
    return data


def write_execution_inputs(layout: RunLayout, spec: JobSpec, name: str, first_round: int,
                           last_round: int) -> Path:
    """The job order of an execution of main.cwl that starts later or stops sooner.

    ``xffl resume`` starts from the round after the last completed one (from its global
    model, and the job files balanced for that round, if any); a cron tick (``xffl round``)
    runs one round. The CWL is the plan's, unchanged.
    """
    path = layout.execution_inputs(name)
    data = loop_inputs(spec, first_round, last_round, base="../")
    for site in spec.sites:
        job = layout.round_job(first_round, site.name)
        if job.is_file():
            data[f"job_{site.name}"]["path"] = f"../{job.relative_to(layout.root)}"
    _dump(path, data)
    return path


def site_data(profile: SiteProfile, site: SiteSpec) -> DataSpec:
    """The site's data section as its trainer reads it: a held-out directory on its filesystem
    (``data.validation.path``, like ``data.path``, is relative to its workdir)."""
    held_out = site.data.validation
    if held_out is None or held_out.path is None:
        return site.data
    path = site_data_path(profile, site.name, held_out.path)
    return site.data.model_copy(update={"validation": held_out.model_copy(update={"path": path})})


def write_plan(loaded: LoadedJob, run_id: str, out: Path,
               run_dir: Path | None = None) -> RunLayout:
    """Write the complete plan for ``loaded`` into ``out`` and return its layout.

    ``run_dir`` is where the plan will finally live (when ``out`` is a staging folder);
    absolute paths inside the plan point there. ``job.json`` is the job spec as resolved.
    """
    out = Path(out).resolve()
    final = Path(run_dir).resolve() if run_dir is not None else out
    staged = RunLayout(out)
    spec = loaded.spec
    names = [s.name for s in spec.sites]
    staged.job_json.parent.mkdir(parents=True, exist_ok=True)
    # the job as resolved: what the coordinator's steps read it from (one source)
    staged.job_json.write_text(spec.model_dump_json(indent=2) + "\n")
    envs = site_envs(spec, {s.name: loaded.site_profile(s.name) for s in spec.sites})
    for site in spec.sites:
        profile = loaded.site_profile(site.name)
        data_path = site_data_path(profile, site.name, site.data.path)
        training = site.budget.apply(spec.training) if site.budget else spec.training
        job = TrainJob(run_id=run_id, site=site.name, rounds=spec.rounds, model=spec.model,
                       training=training, data=site_data(profile, site), exchange=spec.exchange,
                       freeze_a=spec.freeze_a, evaluation=spec.evaluation)
        job_file = staged.job_file(site.name)
        job_file.parent.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job.model_dump(mode="json"), indent=2) + "\n")
        _dump(staged.tool(f"train_{site.name}"), cwl.train_tool(
            run_id=run_id, site=site.name, python=site_python(profile),
            launcher=profile.launcher, ranks=site.ranks, data=data_path,
            keep=kept_updates_dir(profile, site.name, run_id),
            env=envs[site.name],
            slurm=profile.slurm is not None, time_limit=train_time_limit(spec),
            lora=spec.training.lora is not None))
        if profile.slurm is not None:
            for path, by_hand in ((staged.batch_script(site.name), True),
                                  (staged.batch_template(site.name), False)):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(batch_script(run_id, site.name, profile, site.ranks, data_path,
                                             by_hand=by_hand,
                                             lora=spec.training.lora is not None,
                                             chain_margin=signal_margin(spec)))
            staged.batch_script(site.name).chmod(0o700)  # runnable by its owner alone
    evaluated = skipped(spec) is None  # the final model's evaluation: steps of main.cwl
    if evaluated:
        write_evaluate_tools(staged, run_id, spec,
                             {s.name: loaded.site_profile(s.name) for s in spec.sites}, envs)
        _dump(staged.tool(cwl.FINAL_STEP), cwl.final_validation_tool(str(final), names))
    _dump(staged.tool("admit"), cwl.admit_tool(str(final)))
    _dump(staged.tool("aggregate"), cwl.aggregate_tool(str(final), names, final=evaluated))
    lora = spec.training.lora is not None
    _dump(staged.round_cwl, cwl.round_workflow(
        names, {s.name: report_bounds(spec, s) for s in spec.sites}, lora=lora,
        final=evaluated))
    _dump(staged.main, cwl.main_workflow(names, lora=lora, final=evaluated))
    _dump(staged.inputs, loop_inputs(spec, 1, spec.rounds))
    _dump(staged.streamflow, streamflow_config(run_id, loaded, out, final))
    # the resolved site profiles (the spec's slurm overrides applied), for `xffl status/cancel/
    # logs` to reach the sites (no secrets: key_file is a path)
    staged.profiles.write_text(json.dumps(
        {s.name: loaded.site_profile(s.name).model_dump(mode="json") for s in spec.sites},
        indent=2) + "\n")
    return staged


def write_initial_model(layout: RunLayout, spec: JobSpec, run_id: str,
                        trusted: bool = False,
                        progress: Callable[[int, int], None] | None = None) -> None:
    """Write the round-0 global checkpoint (the seeded initial model) unless it exists.

    A seeded model comes from the cache of initial models when an earlier run built it
    (:mod:`xffl.workflows.plan.init_cache`), else it is built and cached. When that needs the
    spec's ``model.entry_point``, only if the user ``trusted`` it (:mod:`xffl.jobs.spec.trust`).
    A LoRA job's frozen base keeps ``model.init``'s dtypes (a bf16 checkpoint stays bf16: it
    is never trained, and the sites load it in their own compute dtype). ``progress`` follows
    the writing of the model: (elements written, elements in all).
    """
    from xffl.aggregator.exchange import MANIFEST_FILE
    from xffl.core.sizes import parse_size
    from xffl.jobs.spec.trust import check_round0

    lora = spec.training.lora
    if (layout.initial_model / MANIFEST_FILE).is_file():
        return
    check_round0(spec, trusted)
    # a LoRA job's frozen base is what a whole-model job starts from; its round-0 global is
    # the adapter, written after the base
    base = layout.base_model if lora is not None else layout.initial_model
    if not (base / MANIFEST_FILE).is_file():
        shard_bytes = parse_size(spec.aggregation.max_shard_size)
        key = init_cache.init_key(spec.model, spec.training.seed, shard_bytes)
        if key is None or not init_cache.reuse(key, base, run_id):
            from xffl.training.checkpoint import init_global  # torch is heavy: only when needed

            init_global(run_id, spec.model, spec.training.seed, base, shard_bytes,
                        keep_dtype=lora is not None, progress=progress)
            if key is not None:
                init_cache.store(key, base)
    if lora is not None:
        from xffl.training.lora import init_adapter_global

        init_adapter_global(run_id, spec.model, lora, spec.training.seed,
                            layout.initial_model, str(base))
