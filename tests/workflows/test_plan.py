"""The compiled plan: CWL that cwltool accepts, bindings per site, no absolute staging paths."""

from __future__ import annotations

from pathlib import Path

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
