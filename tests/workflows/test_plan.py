"""The compiled plan: CWL that cwltool accepts, bindings per site, no absolute staging paths."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import yaml

from tests.conftest import QUICKSTART
from xffl.jobs.load import load_job
from xffl.workflows.plan import write_plan
from xffl.workflows.validate import validate_cwl


def test_plan_files_and_cwltool_validate(tmp_path: Path) -> None:
    loaded = load_job(QUICKSTART)
    paths = write_plan(loaded, "qs-1", tmp_path / "plan", tmp_path / "reg.db")
    root = paths.root
    for rel in ["main.cwl", "round.cwl", "tools/train_alpha.cwl", "tools/train_beta.cwl",
                "tools/aggregate.cwl", "inputs.yml", "streamflow.yml", "jobs/alpha.json",
                "jobs/beta.json"]:
        assert (root / rel).is_file(), rel
    # cwltool, the reference implementation, accepts both workflows
    validate_cwl(root / "main.cwl")
    validate_cwl(root / "round.cwl")
    for site in ("alpha", "beta"):  # the per-site round plan the runner executes
        validate_cwl(root / "sites" / f"{site}.cwl")
    sites_cfg = yaml.safe_load((root / "streamflow-sites.yml").read_text())
    assert sites_cfg["workflows"]["qs-1-alpha"]["bindings"] == [
        {"step": "/train_alpha", "target": {"deployment": "site-alpha"}}]
    assert sites_cfg["deployments"] == yaml.safe_load(
        (root / "streamflow.yml").read_text())["deployments"]

    main = yaml.safe_load((root / "main.cwl").read_text())
    loop = main["steps"]["rounds"]["requirements"]["cwltool:Loop"]
    assert loop["loopWhen"] == "$(inputs.go)"  # a parameter reference: no JavaScript engine
    assert loop["loop"] == {"round": "next_round", "model": "model", "go": "go"}

    sf = yaml.safe_load((root / "streamflow.yml").read_text())
    binding = {b["step"]: b["target"]["deployment"] for b in sf["workflows"]["qs-1"]["bindings"]}
    assert binding == {"/rounds/train_alpha": "site-alpha", "/rounds/train_beta": "site-beta"}
    assert sf["database"]["config"]["connection"] == str(root / "streamflow" / "sqlite.db")

    train = yaml.safe_load((root / "tools" / "train_alpha.cwl").read_text())
    args = train["arguments"]
    assert args[args.index("--ranks") + 1] == "2"
    data = args[args.index("--data") + 1]
    assert data.endswith("/sites/alpha/data/alpha")


def test_staged_plan_points_at_final_dir(tmp_path: Path) -> None:
    loaded = load_job(QUICKSTART)
    final = tmp_path / "final"
    paths = write_plan(loaded, "qs-2", tmp_path / "staging", tmp_path / "reg.db", run_dir=final)
    text = "".join(p.read_text() for p in paths.root.rglob("*") if p.is_file())
    assert str(tmp_path / "staging") not in text
    agg = yaml.safe_load((paths.root / "tools" / "aggregate.cwl").read_text())
    assert agg["arguments"][agg["arguments"].index("--run-dir") + 1] == str(final)
    inputs = yaml.safe_load((paths.root / "inputs.yml").read_text())
    assert inputs["model"] == {"class": "Directory", "path": "rounds/0/global"}


def test_strategy_reaches_the_aggregate_step(tmp_path: Path) -> None:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["aggregation"] = {"strategy": "fedyogi", "weighting": "tokens", "params": {"eta": 0.05}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    paths = write_plan(load_job(job), "qs-3", tmp_path / "plan", tmp_path / "reg.db")
    args = yaml.safe_load((paths.root / "tools" / "aggregate.cwl").read_text())["arguments"]
    assert args[args.index("--strategy") + 1] == "fedyogi"
    assert args[args.index("--weighting") + 1] == "tokens"
    assert "--param=eta=0.05" in args
    validate_cwl(paths.main)


def test_site_slurm_overrides_reach_the_batch_script_and_streamflow(tmp_path: Path) -> None:
    from tests.jobs.test_slurm_overrides import job_with_overrides

    job = job_with_overrides(tmp_path, {"partition": "gpu", "time": "00:20:00", "qos": "fast",
                                        "account": None, "extra": ["--exclusive"]})
    paths = write_plan(load_job(job), "qs-4", tmp_path / "plan", tmp_path / "reg.db")
    script = (paths.root / "sbatch" / "alpha.sh").read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=00:20:00", "#SBATCH --qos=fast",
                 "#SBATCH --exclusive", "#SBATCH --job-name=xffl-qs-4-alpha",
                 "--slurm-job-name xffl-qs-4-alpha-r\"$ROUND\""):
        assert line in script, line
    assert "--partition=batch" not in script and "acct1" not in script  # overridden
    assert not (paths.root / "sbatch" / "beta.sh").exists()  # beta runs locally
    sf = yaml.safe_load((paths.root / "streamflow.yml").read_text())
    deployment = sf["deployments"]["slurm-alpha"]
    service = deployment["config"]["services"]["train"]
    assert (service["partition"], service["time"], service["qos"]) == ("gpu", "00:20:00", "fast")
    assert "account" not in service and service["jobName"] == "xffl-qs-4-alpha"
    assert deployment["config"]["pollingInterval"] == 2  # kept from the profile
    # StreamFlow has no key for extra options: they are #SBATCH lines of its batch template
    template = jinja2.Template((paths.root / "sbatch" / "alpha.j2").read_text())
    rendered = template.render(streamflow_command="python -m xffl.training.launch").splitlines()
    assert rendered[:2] == ["#!/bin/bash", "#SBATCH --exclusive"]
    assert rendered[-1] == "python -m xffl.training.launch"
    # the launcher gets the round's job name at the SLURM site only
    args = yaml.safe_load((paths.root / "tools" / "train_alpha.cwl").read_text())["arguments"]
    assert args[args.index("--slurm-job-name") + 1] == "xffl-qs-4-alpha-r$(inputs.round)"
    beta = yaml.safe_load((paths.root / "tools" / "train_beta.cwl").read_text())["arguments"]
    assert "--slurm-job-name" not in beta
    profiles = json.loads((paths.root / "profiles.json").read_text())
    assert profiles["alpha"]["slurm"]["partition"] == "gpu"  # status/cancel see the same
    validate_cwl(paths.main)
