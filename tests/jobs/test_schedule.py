"""Cron rounds: the crontab line xffl installs, run as cron runs it, advances the run a round."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.jobs.schedule import current

runner = CliRunner()


def _crontab() -> str:
    out = subprocess.run(["crontab", "-l"], capture_output=True, text=True, check=False)
    return out.stdout if out.returncode == 0 else ""


@pytest.mark.slow
@pytest.mark.serial
def test_schedule_line_runs_under_env_i_and_remove(tmp_path: Path, xffl_home: Path) -> None:
    """Installed, the line is what `xffl schedule` printed; removed, it is gone; installed
    again, cron's tick (an empty environment, /bin/sh) runs the job's one round, which ends the
    run, and the tick removes the entry itself. (A tick that leaves a run waiting for the
    next: tests/workflows/test_other_format_round.py.)"""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="cronjob", rounds=1)
    spec["training"].update(steps=2, batch_size=2)
    # one site of one rank: the cron line, its tick and its removal are the same for any
    # number of sites (cron ticks of a two-site run: tests/workflows/test_failure_slurm.py)
    spec["sites"] = spec["sites"][:1]
    for site in spec["sites"]:
        site.update(ranks=1)
        site["data"]["synthetic_sequences"] = 32
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    submitted = json.loads(runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
                           .stdout)
    run_id = submitted["run_id"]
    result = runner.invoke(app, ["schedule", run_id, "--cron", "*/5 * * * *", "--json"])
    assert result.exit_code == 0, result.output
    shown = check("schedule", json.loads(result.stdout))
    try:
        lines = [ln for ln in _crontab().splitlines() if f"# xffl:{run_id}" in ln]
        assert len(lines) == 1 and lines[0].startswith("*/5 * * * * ")
        command = lines[0][len("*/5 * * * * "):].rsplit(" # xffl:", 1)[0]
        assert command == shown["command"]
        status = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
        assert status["schedule"]["cron"] == "*/5 * * * *"
        assert status["schedule"]["next_tick"].endswith(":00")
        removed = runner.invoke(app, ["schedule", run_id, "--remove"])
        assert removed.exit_code == 0 and "removed" in removed.stdout
        assert f"xffl:{run_id}" not in _crontab() and current(run_id) is None
        # installed again: what cron does, an empty environment, the line's own command
        # through /bin/sh; the tick that runs the last round removes the entry itself
        assert runner.invoke(app, ["schedule", run_id, "--cron", "*/5 * * * *"]).exit_code == 0
        assert current(run_id) is not None
        tick = subprocess.run(["env", "-i", "/bin/sh", "-c", command], capture_output=True,
                              text=True, timeout=300, check=False)
        assert tick.returncode == 0, tick.stderr
        status = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
        assert status["state"] == "completed" and status["rounds_done"] == 1
        assert status["schedule"] is None
        assert f"xffl:{run_id}" not in _crontab() and current(run_id) is None
        log = (Path(submitted["run_dir"]) / "cron.log").read_text()
        assert f"run {run_id}: completed" in log
        assert "its cron entry is removed (no round is left to run)" in log
    finally:
        runner.invoke(app, ["schedule", run_id, "--remove"])
    assert f"xffl:{run_id}" not in _crontab() and current(run_id) is None


def test_bad_cron_expression_exit_2(tmp_path: Path, xffl_home: Path) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    run_id = json.loads(runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
                        .stdout)["run_id"]
    result = runner.invoke(app, ["schedule", run_id, "--cron", "61 * * * *"])
    assert result.exit_code == 2
    assert "cron expression '61 * * * *': the minute field '61' is not valid" in result.stderr
    assert current(run_id) is None
