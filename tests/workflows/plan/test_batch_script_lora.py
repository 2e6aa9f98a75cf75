"""The hand-run batch script of a LoRA job passes the frozen base model, as the workflow's
tool does: the `sft-lora` template, its site alpha on a SLURM profile, rendered and run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.workflows.warm_ranks import warm_env
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app

runner = CliRunner()


@pytest.mark.slow
def test_sft_lora_batch_script_runs_by_hand(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`xffl init -t sft-lora`, alpha moved to a SLURM profile, `xffl render`; the script
    `sbatch/alpha.sh` run from the plan folder as sbatch would (bash, no SLURM here: the
    profile's launcher is none) trains round 1 and writes alpha's adapter update."""
    monkeypatch.chdir(tmp_path)
    done = runner.invoke(app, ["init", "-t", "sft-lora", "demo"])
    assert done.exit_code == 0, done.output
    (tmp_path / "demo" / "site_profiles").mkdir()
    (tmp_path / "demo" / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump({
        "name": "cluster", "connector": {"type": "ssh", "host": "login.example.org",
                                         "user": "me"},
        "slurm": {"partition": "batch", "time": "00:10:00"}, "launcher": "none",
        "python": sys.executable, "workdir": str(tmp_path / "work")}))
    job = tmp_path / "demo" / "job.yaml"
    spec = yaml.safe_load(job.read_text())
    spec["training"]["steps"] = 2
    spec["sites"][0].update(profile="cluster", ranks=1)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    plan = tmp_path / "plan"
    done = runner.invoke(app, ["render", str(job), "-o", str(plan)])
    assert done.exit_code == 0, done.output
    script = (plan / "sbatch" / "alpha.sh").read_text()
    assert "BASE=${5:-rounds/0/base}" in script and '--base "$BASE"' in script, script

    # warm ranks (tests/workflows/warm_ranks.py): the script by hand is under test, not the
    # ranks' imports
    env = warm_env({k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))})
    ran = subprocess.run(["bash", "sbatch/alpha.sh"], cwd=plan, env=env, text=True,
                         capture_output=True, timeout=300, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    update = verify_checkpoint(plan / "updates" / "alpha-r1")
    assert update.kind == "update" and update.site == "alpha" and update.round == 1
    assert update.parent == verify_checkpoint(plan / "rounds" / "0" / "global").digest()
