"""CLI: a job spec's per-site SLURM overrides, refused for a site whose profile has no SLURM."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests.jobs.test_slurm_overrides import job_with_overrides
from xffl.cli.app import app

runner = CliRunner()


def test_slurm_override_on_a_local_site_exits_2(tmp_path: Path, xffl_home: Path) -> None:
    job = job_with_overrides(tmp_path, {"partition": "gpu"}, profile="local")
    for command in (["validate", str(job)], ["render", str(job), "-o", str(tmp_path / "p")],
                    ["submit", str(job)]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, result.stderr
        assert errors[0].startswith(f"error: {job}:") and (
            "job spec field sites[0].slurm: site 'alpha' overrides SLURM settings, but its "
            "profile 'local' has no slurm section") in errors[0]
        assert "Traceback" not in result.output
    assert not (tmp_path / "p").exists() and not (xffl_home / "runs").exists()


def test_slurm_override_renders(tmp_path: Path) -> None:
    job = job_with_overrides(tmp_path, {"partition": "gpu", "nodes": 2})
    result = runner.invoke(app, ["render", str(job), "-o", str(tmp_path / "plan")])
    assert result.exit_code == 0, result.output
    script = (tmp_path / "plan" / "sbatch" / "alpha.sh").read_text()
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --nodes=2" in script
