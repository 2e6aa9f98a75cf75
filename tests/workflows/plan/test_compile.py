"""The compiled plan: CWL that cwltool accepts, the loop, bindings, failure policy, one template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.spec.load import load_job
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.plan.compile import write_execution_inputs, write_plan
from xffl.workflows.plan.validate import validate_cwl


def _job(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    data.update(changes)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def test_plan_files_and_cwltool_validate(tmp_path: Path, xffl_home: Path) -> None:
    loaded = load_job(QUICKSTART)
    layout = write_plan(loaded, "qs-1", tmp_path / "plan")
    root = layout.root
    for rel in ["main.cwl", "round.cwl", "tools/train_alpha.cwl", "tools/train_beta.cwl",
                "tools/admit.cwl", "tools/aggregate.cwl", "inputs.yml", "streamflow.yml",
                "jobs/alpha.json", "jobs/beta.json", "profiles.json", "job.json"]:
        assert (root / rel).is_file(), rel
    assert not layout.registration.exists()  # a plan is registered only by `xffl submit`
    # cwltool, the reference implementation, accepts the cyclic workflow and its round
    validate_cwl(layout.main)
    validate_cwl(layout.round_cwl)

    main = yaml.safe_load(layout.main.read_text())
    loop = main["steps"]["rounds"]["requirements"]["cwltool:Loop"]
    assert loop["loopWhen"] == "$(inputs.go)"  # a parameter reference: no JavaScript engine
    assert loop["loop"] == {"round": "next_round", "model": "model", "go": "go",
                            "job_alpha": "job_alpha", "job_beta": "job_beta"}
    steps = yaml.safe_load(layout.round_cwl.read_text())["steps"]
    assert set(steps) == {"train_alpha", "admit_alpha", "train_beta", "admit_beta",
                          "aggregate"}
    assert steps["admit_beta"]["in"]["update"] == "train_beta/update"
    assert steps["admit_beta"]["in"]["site"] == {"default": "beta"}  # the coordinator's name
    assert steps["aggregate"]["in"]["update_beta"] == "admit_beta/update"

    sf = yaml.safe_load(layout.streamflow.read_text())
    binding = {b["step"]: b["target"]["deployment"] for b in sf["workflows"]["qs-1"]["bindings"]}
    assert binding == {"/rounds/train_alpha": "site-alpha", "/rounds/train_beta": "site-beta",
                       "/rounds/admit_alpha": "coordinator", "/rounds/admit_beta": "coordinator",
                       "/rounds/aggregate": "coordinator",
                       # the final model's evaluation (tests/workflows/plan/test_final_steps.py)
                       "/final_evaluate_alpha": "site-alpha", "/final_evaluate_beta": "site-beta",
                       "/final_validation": "coordinator"}
    # the coordinator's steps work inside the run directory: hard links, nothing copied
    assert sf["deployments"]["coordinator"] == {
        "type": "local", "config": {}, "workdir": str(root / "streamflow" / "work")}
    assert sf["deployments"]["site-alpha"] == {
        "type": "xffl-local", "config": {}, "workdir": str(xffl_home / "sites" / "alpha")}
    assert sf["database"]["config"]["connection"] == str(root / "streamflow" / "sqlite.db")
    assert sf["failureManager"] == {
        "enabled": True, "type": "xffl",
        "config": {"retries": 0, "retry_delay": 0.0, "run_dir": str(root), "sites": {
            s: [f"/rounds/train_{s}", f"/rounds/admit_{s}/__transfer__/update"]
            for s in ("alpha", "beta")}, "final": {
            s: [f"/final_evaluate_{s}", f"/final_validation/__transfer__/evaluation_{s}"]
            for s in ("alpha", "beta")}}}

    train = yaml.safe_load((root / "tools" / "train_alpha.cwl").read_text())
    args = train["arguments"]
    assert args[args.index("--ranks") + 1] == "2"
    assert args[args.index("--data") + 1] == str(xffl_home / "sites" / "alpha" / "data" / "alpha")
    keep = args[args.index("--keep") + 1]
    assert keep == str(xffl_home / "sites" / "alpha" / "kept" / "qs-1")  # at the site
    # both local sites train at once on this machine: their 2 + 2 ranks share its CPUs
    for site in ("alpha", "beta"):
        tool = yaml.safe_load((root / "tools" / f"train_{site}.cwl").read_text())
        assert tool["requirements"]["EnvVarRequirement"]["envDef"] == {
            "PYTHONUNBUFFERED": "1", "XFFL_LOCAL_RANKS": "4"}
    assert "ToolTimeLimit" not in train["requirements"]  # no failure.round_timeout

    inputs = yaml.safe_load(layout.inputs.read_text())
    assert inputs == {"first_round": 1, "max_rounds": 3,
                      "model": {"class": "Directory", "path": "rounds/0/global"},
                      "job_alpha": {"class": "File", "path": "jobs/alpha.json"},
                      "job_beta": {"class": "File", "path": "jobs/beta.json"}}


def test_execution_inputs_start_from_a_later_round(tmp_path: Path) -> None:
    loaded = load_job(QUICKSTART)
    layout = write_plan(loaded, "qs-5", tmp_path / "plan")
    layout.round_job(2, "beta").parent.mkdir(parents=True)
    layout.round_job(2, "beta").write_text("{}")  # balanced for round 2 by round 1
    path = write_execution_inputs(layout, loaded.spec, "tick", 2, 2)
    data = yaml.safe_load(path.read_text())
    assert (data["first_round"], data["max_rounds"]) == (2, 2)
    assert (path.parent / data["model"]["path"]).resolve() == layout.global_dir(1).resolve()
    assert (path.parent / data["job_alpha"]["path"]).resolve() == layout.job_file("alpha")
    assert (path.parent / data["job_beta"]["path"]).resolve() == layout.round_job(2, "beta")


def test_staged_plan_points_at_final_dir(tmp_path: Path) -> None:
    loaded = load_job(QUICKSTART)
    final = tmp_path / "final"
    layout = write_plan(loaded, "qs-2", tmp_path / "staging", run_dir=final)
    text = "".join(p.read_text() for p in layout.root.rglob("*") if p.is_file())
    assert str(tmp_path / "staging") not in text
    for tool in ("aggregate", "admit"):
        agg = yaml.safe_load(layout.tool(tool).read_text())
        assert agg["arguments"][agg["arguments"].index("--run-dir") + 1] == str(final)
    sf = yaml.safe_load(layout.streamflow.read_text())
    assert sf["failureManager"]["config"]["run_dir"] == str(final)


def test_job_spec_reaches_the_aggregate_step_and_the_failure_manager(tmp_path: Path) -> None:
    job = _job(tmp_path, aggregation={"strategy": "fedyogi", "weighting": "tokens",
                                      "params": {"eta": 0.05}, "max_shard_size": "1MB"},
               failure={"retries": 2, "retry_delay": 1.5, "min_sites": 1,
                        "round_timeout": 90.5})
    loaded = load_job(job)
    layout = write_plan(loaded, "qs-3", tmp_path / "plan")
    # the aggregate step reads the job from the plan's job.json, the one source: its command
    # line names the run and its sites, nothing of the job's
    args = yaml.safe_load(layout.tool("aggregate").read_text())["arguments"]
    assert args == ["--run-dir", str(layout.root), "--sites", "alpha,beta"]
    spec = JobSpec.of_run(layout.root)
    assert spec == loaded.spec
    agg = spec.aggregation
    assert (agg.strategy, agg.weighting, agg.params, agg.max_shard_size, spec.quorum) == \
        ("fedyogi", "tokens", {"eta": 0.05}, "1MB", 1)
    config = yaml.safe_load(layout.streamflow.read_text())["failureManager"]["config"]
    assert (config["retries"], config["retry_delay"]) == (2, 1.5)
    train = yaml.safe_load(layout.tool("train_beta").read_text())
    assert train["requirements"]["ToolTimeLimit"] == {"timelimit": 91}  # whole seconds, up
    validate_cwl(layout.main)


def test_influence_bounds_reach_the_aggregate_step(tmp_path: Path) -> None:
    job = _job(tmp_path, aggregation={"clip_norm": 0.5, "max_weight_share": 0.4})
    layout = write_plan(load_job(job), "qs-5", tmp_path / "plan")
    agg = JobSpec.of_run(layout.root).aggregation
    assert (agg.clip_norm, agg.max_weight_share) == (0.5, 0.4)
    (tmp_path / "plain").mkdir()
    plain = write_plan(load_job(_job(tmp_path / "plain")), "qs-6", tmp_path / "plan-plain")
    agg = JobSpec.of_run(plain.root).aggregation
    assert (agg.clip_norm, agg.max_weight_share) == (None, None)


def test_site_slurm_overrides_reach_both_batch_scripts(tmp_path: Path) -> None:
    from tests.jobs.test_slurm_overrides import job_with_overrides

    job = job_with_overrides(tmp_path, {"partition": "gpu", "time": "00:20:00", "qos": "fast",
                                        "account": None, "extra": ["--exclusive"]})
    layout = write_plan(load_job(job), "qs-4", tmp_path / "plan")
    script = layout.batch_script("alpha").read_text()
    header = ["#SBATCH --job-name=xffl-qs-4-alpha", "#SBATCH --nodes=1", "#SBATCH --ntasks=2",
              "#SBATCH --time=00:20:00", "#SBATCH --partition=gpu", "#SBATCH --qos=fast",
              "#SBATCH --exclusive"]
    assert [ln for ln in script.splitlines() if ln.startswith("#SBATCH")] == header
    assert "--slurm-job-name xffl-qs-4-alpha-r\"$ROUND\"" in script
    assert "--partition=batch" not in script and "acct1" not in script  # overridden
    assert not layout.batch_script("beta").exists()  # beta runs locally
    assert layout.batch_script("alpha").stat().st_mode & 0o777 == 0o700  # its owner's alone
    # the hand-run script names paths at the facility (relative to where it is submitted),
    # never the folder it was rendered into
    assert str(layout.root) not in script
    assert 'MODEL=${2:-rounds/0/global}' in script and 'JOB=${3:-jobs/alpha.json}' in script

    sf = yaml.safe_load(layout.streamflow.read_text())
    deployment = sf["deployments"]["slurm-alpha"]
    assert deployment["type"] == "xffl-slurm" and deployment["wraps"] == "login-alpha"
    # every sbatch option is in the template, as in the hand-run script: one source
    assert deployment["config"]["services"] == {
        "train": {"file": str(layout.batch_template("alpha"))}}
    assert deployment["config"]["pollingInterval"] == 2  # kept from the profile
    rendered = jinja2.Template(layout.batch_template("alpha").read_text()).render(
        streamflow_command="python -m xffl.training.launch").splitlines()
    assert rendered[0] == "#!/bin/bash" and rendered[-1] == "python -m xffl.training.launch"
    assert [ln for ln in rendered if ln.startswith("#SBATCH")] == header
    # a round's command names its job: StreamFlow submits it under the round's name
    command = "python -m xffl.training.launch --slurm-job-name xffl-qs-4-alpha-r7 -- --round 7"
    rendered = jinja2.Template(layout.batch_template("alpha").read_text()).render(
        streamflow_command=command).splitlines()
    assert [ln for ln in rendered if ln.startswith("#SBATCH")] == \
        ["#SBATCH --job-name=xffl-qs-4-alpha-r7", *header[1:]]
    # the launcher gets the round's job name at the SLURM site only
    args = yaml.safe_load(layout.tool("train_alpha").read_text())["arguments"]
    assert args[args.index("--slurm-job-name") + 1] == "xffl-qs-4-alpha-r$(inputs.round)"
    beta = yaml.safe_load(layout.tool("train_beta").read_text())["arguments"]
    assert "--slurm-job-name" not in beta
    profiles = json.loads(layout.profiles.read_text())
    assert profiles["alpha"]["slurm"]["partition"] == "gpu"  # status/cancel see the same
    validate_cwl(layout.main)


def test_site_lines_reach_the_job_as_written(tmp_path: Path) -> None:
    """StreamFlow renders the template a second time: the site's own lines stay literal."""
    from tests.jobs.test_slurm_overrides import SLURM_PROFILE, job_with_overrides

    job = job_with_overrides(tmp_path, None)
    profile = dict(SLURM_PROFILE, setup=["echo '{{ 7 * 7 }}' ${#PATH} {# not a comment #}"],
                   env={"GREETING": "{{ lipsum }}"})
    (tmp_path / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump(profile))
    layout = write_plan(load_job(job), "qs-6", tmp_path / "plan")
    rendered = jinja2.Template(layout.batch_template("alpha").read_text()).render(
        streamflow_command="true")
    assert "echo '{{ 7 * 7 }}' ${#PATH} {# not a comment #}" in rendered.splitlines()
    assert "export GREETING='{{ lipsum }}'" in rendered.splitlines()
    assert "echo '{{ 7 * 7 }}'" in layout.batch_script("alpha").read_text()


@pytest.mark.parametrize("field", ["setup", "env", "extra"])
def test_a_jinja2_statement_in_a_site_line_is_refused(tmp_path: Path, field: str) -> None:
    from tests.jobs.test_slurm_overrides import SLURM_PROFILE, job_with_overrides

    job = job_with_overrides(tmp_path, None)
    evil = "{% endraw %}{{ lipsum.__globals__.os.system('id') }}{% raw %}"
    profile: dict[str, object] = dict(SLURM_PROFILE)
    if field == "setup":
        profile["setup"] = [evil]
    elif field == "env":
        profile["env"] = {"X": evil}
    else:
        profile["slurm"] = dict(SLURM_PROFILE["slurm"], extra=[evil])  # type: ignore[arg-type]
    (tmp_path / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump(profile))
    with pytest.raises(InvalidInput, match="Jinja2 statement"):
        load_job(job)
    assert not RunLayout(tmp_path / "plan").root.exists()


def test_a_lora_plan_carries_the_frozen_base(tmp_path: Path, xffl_home: Path) -> None:
    """training.lora: the base enters main.cwl once and every round unchanged (not a loop
    value), each site's tool gets it as --base, the admit tool checks freeze_a; cwltool
    accepts the loop with it."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["training"]["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    spec["aggregation"]["lora"] = "freeze_a"
    job = _job(tmp_path, training=spec["training"], aggregation=spec["aggregation"])
    layout = write_plan(load_job(job), "lora-1", tmp_path / "plan")
    validate_cwl(layout.main)
    main = yaml.safe_load(layout.main.read_text())
    loop_step = main["steps"]["rounds"]
    assert main["inputs"]["base"] == "Directory" and loop_step["in"]["base"] == "base"
    assert "base" not in loop_step["requirements"]["cwltool:Loop"]["loop"]
    inputs = yaml.safe_load(layout.inputs.read_text())
    assert inputs["base"] == {"class": "Directory", "path": "rounds/0/base"}
    train = yaml.safe_load(layout.tool("train_alpha").read_text())
    assert train["inputs"]["base"] == "Directory"
    assert train["arguments"][-2:] == ["--base", "$(inputs.base.path)"]
    # the admit step reads the rule from the run's job.json, the plan's one copy of the spec
    assert JobSpec.of_run(layout.root).freeze_a
    assert json.loads(layout.job_file("alpha").read_text())["freeze_a"] is True


@pytest.mark.parametrize("late", ["wait", "adopt"])
def test_late_adopt_bounds_the_train_step_by_the_deadline_and_configures_the_connector(
        tmp_path: Path, late: str) -> None:
    """late: adopt: the train tool's time limit is the round deadline (past it the job is left
    running) and the SLURM site's connector adopts late jobs; late: wait keeps
    failure.round_timeout (past it the job is cancelled) and a plain connector."""
    from tests.jobs.test_slurm_overrides import job_with_overrides

    job = job_with_overrides(tmp_path, None)
    data = yaml.safe_load(job.read_text())
    data["failure"] = {"round_timeout": 900}
    data["round_deadline"] = {"seconds": 120.5, "late": late, "staleness": {"max_rounds": 3}}
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    layout = write_plan(load_job(job), "qs-5", tmp_path / "plan")
    limits = {s: yaml.safe_load(layout.tool(f"train_{s}").read_text())["requirements"]
              ["ToolTimeLimit"]["timelimit"] for s in ("alpha", "beta")}
    assert limits == dict.fromkeys(("alpha", "beta"), 121 if late == "adopt" else 900)
    deployments = yaml.safe_load(layout.streamflow.read_text())["deployments"]
    config = deployments["slurm-alpha"]["config"]
    # no copy to or from the SSH site outlasts the time limit of the round's job
    assert deployments["login-alpha"]["config"]["copyTimeout"] == \
        (120.5 if late == "adopt" else 900)
    if late == "adopt":
        assert config["late"] == {"runDir": str(layout.root), "site": "alpha", "maxRounds": 3}
    else:
        assert "late" not in config


def test_batch_script_passes_cpus_per_task_to_srun(tmp_path: Path) -> None:
    """srun does not inherit the allocation's --cpus-per-task (SLURM 22.05 on): the batch
    script exports SRUN_CPUS_PER_TASK from SLURM_CPUS_PER_TASK, which srun reads. The
    rendered template runs under bash: with the job's value set, srun's variable carries it;
    without it, srun's is left unset (an empty value would be an invalid option to srun)."""
    import os
    import subprocess

    from tests.jobs.test_slurm_overrides import job_with_overrides

    job = job_with_overrides(tmp_path, {"cpus_per_task": 2})
    layout = write_plan(load_job(job), "qs-7", tmp_path / "plan")
    probe = 'echo "srun sees ${SRUN_CPUS_PER_TASK-unset}"'
    script = jinja2.Template(layout.batch_template("alpha").read_text()).render(
        streamflow_command=probe)
    assert "#SBATCH --cpus-per-task=2" in script.splitlines()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    for given, seen in (({"SLURM_CPUS_PER_TASK": "2"}, "2"), ({}, "unset"),
                        ({"SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "1"}, "1")):
        out = subprocess.run(["bash", "-c", script], env={**env, **given}, text=True,
                             capture_output=True, check=True).stdout
        assert out.strip().splitlines()[-1] == f"srun sees {seen}", given
    # the hand-run script does the same before it starts the launcher
    hand = layout.batch_script("alpha").read_text()
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in hand
    assert hand.index("SRUN_CPUS_PER_TASK") < hand.index("-m xffl.training.launch")
