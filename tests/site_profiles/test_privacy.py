"""`xffl submit` refuses a site whose workdir other users can write (exit 3, nothing written).

Read at the site itself: over SSH on the real stack for a SLURM site, on this machine for a
local one; the workdir of a site that has none yet is created 0700.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.site_profiles.test_remote import write_profile
from xffl.cli.submit import submit
from xffl.site_profiles.privacy import problem

app = typer.Typer()
app.command("submit")(submit)
app.command("unused")(lambda: None)  # two commands: `submit` stays a subcommand
runner = CliRunner()


def _job(tmp_path: Path, profile: str) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"] = spec["sites"][:1]
    spec["sites"][0]["profile"] = profile
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _refused(job: Path, xffl_home: Path, workdir: str) -> None:
    result = runner.invoke(app, ["submit", str(job), "--no-start"])
    assert result.exit_code == 3, result.output
    assert "workdir is not private" in result.output and workdir in result.output
    assert "chmod go-w" in result.output
    runs = xffl_home / "runs"
    assert not runs.exists() or not any(runs.iterdir())


def test_problem_reads_mode_and_owner() -> None:
    assert problem("/w", 0o700, 5, 5) is None and problem("/w", 0o755, 5, 5) is None
    assert "mode 0775" in (problem("/w", 0o775, 5, 5) or "")
    assert "mode 0777" in (problem("/w", 0o777, 5, 5) or "")
    assert "another user (uid 6)" in (problem("/w", 0o700, 6, 5) or "")


def test_a_local_workdir_others_can_write_fails_the_submit(tmp_path: Path,
                                                            xffl_home: Path) -> None:
    workdir = tmp_path / "shared"
    workdir.mkdir()
    workdir.chmod(0o777)
    (tmp_path / "site_profiles").mkdir()
    (tmp_path / "site_profiles" / "mine.yaml").write_text(
        yaml.safe_dump({"name": "mine", "workdir": str(workdir)}))
    _refused(_job(tmp_path, "mine"), xffl_home, str(workdir))
    # a workdir not there yet is created owner-only, and the submit goes on
    (tmp_path / "site_profiles" / "mine.yaml").write_text(
        yaml.safe_dump({"name": "mine", "workdir": str(tmp_path / "new" / "w")}))
    result = runner.invoke(app, ["submit", str(_job(tmp_path, "mine")), "--no-start"])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "new" / "w").stat().st_mode) == 0o700


@pytest.mark.slow
def test_an_ssh_workdir_others_can_write_fails_the_submit(
        tmp_path: Path, xffl_home: Path, slurm_stack: Any) -> None:
    profile = write_profile(tmp_path / "site_profiles", slurm_stack, cluster="beta")
    workdir = Path(slurm_stack.clusters["beta"].work_dir) / "privacy-test"
    workdir.mkdir(exist_ok=True)
    workdir.chmod(0o777)
    try:
        data = yaml.safe_load(profile.read_text())
        profile.write_text(yaml.safe_dump({**data, "workdir": str(workdir)}))
        _refused(_job(tmp_path, "test-beta"), xffl_home, str(workdir))
    finally:
        workdir.chmod(0o700)
