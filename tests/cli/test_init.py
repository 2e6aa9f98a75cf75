"""`xffl init`: starter jobs from the package, and the paper's two-facility job rendered."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()
JOBS = Path(__file__).resolve().parents[2] / "examples"


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


def sparse_checkpoint(folder: Path, preset: str) -> Path:
    """A Hugging Face checkpoint folder of ``preset``'s real shapes in bf16: config.json and a
    safetensors file whose header is real and whose data is a hole (sparse: no disk used)."""
    from xffl.training.arch import PRESETS
    from xffl.training.model import model_layout

    config = PRESETS[preset]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config.to_json())
    header, offset = {}, 0
    for init in model_layout(config):
        size = 2 * init.numel
        header[init.name] = {"dtype": "BF16", "shape": list(init.shape),
                             "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = folder / "model.safetensors"
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
    os.truncate(path, 8 + len(text) + offset)
    return folder


FACILITY_JOBS = [("two-facilities", "llama2-7b-two-facilities.yaml", "llama2-7b", 1),
                 ("llama3-8b", "llama3.1-8b-two-facilities.yaml", "llama3.1-8b", 1),
                 ("llama3-8b-lora", "llama3.1-8b-lora.yaml", "llama3.1-8b", 1)]


@pytest.mark.parametrize(("template", "spec_file", "preset", "tp"), FACILITY_JOBS)
def test_the_two_facility_jobs(tmp_path: Path, xffl_home: Path, template: str, spec_file: str,
                               preset: str, tp: int) -> None:
    """Leonardo (4 GPUs a node) and Karolina (8): refused while a YOUR_ value is left (the
    base model's folder included: fine-tuning starts from a checkpoint), with file and line;
    filled in with a folder of the model's real shapes, it validates and renders SLURM
    scripts that ask each facility for its GPUs, with the job's tensor parallelism."""
    from xffl.site_profiles.lookup import installed_dirs

    made = runner.invoke(app, ["init", str(tmp_path / "paper"), "-t", template, "--json"])
    assert made.exit_code == 0, made.output
    job = tmp_path / "paper" / "job.yaml"
    profiles = [installed_dirs()[0] / f"{n}.yaml" for n in ("leonardo", "karolina")]
    assert json.loads(made.stdout)["written"] == [str(job), *map(str, profiles)]
    assert job.read_text() == (JOBS / spec_file).read_text()
    assert "init: /path/to/YOUR_MODELS/" in job.read_text()
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
    base = sparse_checkpoint(tmp_path / "base", preset)
    job.write_text("\n".join(f"  init: {base}" if line.startswith("  init: ") else line
                             for line in job.read_text().splitlines()) + "\n")
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
        assert spec["training"]["tensor_parallel"] == tp
        assert spec["model"]["init"] == str(base)
        assert "preset" not in spec["model"]  # the init is the architecture, not a preset
    assert "preset" not in json.loads((plan / "job.json").read_text())["model"]
    # the base's config is the architecture: a config and weights that disagree are refused
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "intermediate_size": 1024}))
    refused = runner.invoke(app, ["validate", str(job)])
    assert refused.exit_code == 2
    line = next(n for n, t in enumerate(job.read_text().splitlines(), 1) if "  init: " in t)
    assert re.search(rf"{re.escape(str(job))}:{line}: job spec field model.init: "
                     r"model.safetensors: tensor model.layers.0.mlp.\w+_proj.weight has shape "
                     r"\(\d+, \d+\), the model expects", refused.stderr)
