"""`xffl init`: starter jobs from the package, and the paper's two-facility job rendered."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()
JOBS = Path(__file__).resolve().parents[2] / "jobs"


def test_init_writes_the_quickstart_once(tmp_path: Path, xffl_home: Path) -> None:
    demo = tmp_path / "demo"
    result = runner.invoke(app, ["init", str(demo)])
    assert result.exit_code == 0, result.output
    assert (demo / "job.yaml").read_text() == QUICKSTART.read_text()  # comments included
    assert result.stdout.splitlines()[-1] == f"next: `xffl submit {demo / 'job.yaml'} --wait`"
    (demo / "job.yaml").write_text("name: mine\n")
    again = runner.invoke(app, ["init", str(demo)])
    assert again.exit_code == 2 and "--force" in again.stderr
    assert (demo / "job.yaml").read_text() == "name: mine\n"  # nothing overwritten
    assert runner.invoke(app, ["init", str(demo), "--force"]).exit_code == 0
    assert (demo / "job.yaml").read_text() == QUICKSTART.read_text()


def test_the_two_facility_job_of_the_paper(tmp_path: Path, xffl_home: Path) -> None:
    """LLaMA-2 7B on Leonardo (4 GPUs a node) and Karolina (8): refused while a YOUR_ value is
    left, with file and line; filled in, it validates and renders SLURM scripts that ask each
    facility for its GPUs, with tensor parallelism 4 inside both."""
    from xffl.site_profiles.lookup import installed_dirs

    made = runner.invoke(app, ["init", str(tmp_path / "paper"), "-t", "two-facilities",
                               "--json"])
    assert made.exit_code == 0, made.output
    job = tmp_path / "paper" / "job.yaml"
    profiles = [installed_dirs()[0] / f"{n}.yaml" for n in ("leonardo", "karolina")]
    assert json.loads(made.stdout)["written"] == [str(job), *map(str, profiles)]
    assert job.read_text() == (JOBS / "llama2-7b-two-facilities.yaml").read_text()
    refused = runner.invoke(app, ["validate", str(job)])
    assert refused.exit_code == 2
    lines = [line.removeprefix("error: ") for line in refused.stderr.splitlines()]
    assert [line.split(": ")[0] for line in lines if ": job spec: " in line] == [
        f"{job}:{n}" for n, text in enumerate(job.read_text().splitlines(), 1)
        if "YOUR_" in text.split("#")[0]]
    assert any(line.startswith(f"{job}:") and f"{profiles[0]}:21: site profile field user"
               in line for line in lines)
    for path in (job, *profiles):
        path.write_text(path.read_text().replace("YOUR_USERNAME", "ada")
                        .replace("YOUR_ACCOUNT", "p_1").replace("YOUR_EMAIL", "a@b.org")
                        .replace("YOUR_VENV", "venv").replace("YOUR_SCRATCH", "scratch"))
    valid = runner.invoke(app, ["validate", str(job)])
    assert valid.exit_code == 0, valid.output
    plan = tmp_path / "plan"
    rendered = runner.invoke(app, ["render", str(job), "-o", str(plan), "--no-init-model"])
    assert rendered.exit_code == 0, rendered.output
    for site, gpus in (("leonardo", 4), ("karolina", 8)):
        script = (plan / "sbatch" / f"{site}.sh").read_text()
        assert f"#SBATCH --gpus-per-node={gpus}" in script
        assert f"#SBATCH --ntasks-per-node={gpus}" in script
        spec = json.loads((plan / "jobs" / f"{site}.json").read_text())
        assert spec["training"]["tensor_parallel"] == 4
        assert spec["model"]["preset"] == "llama2-7b"
