"""``xffl validate`` on training.checkpoint: an interval shorter than a checkpoint, a keep of
0 and a SLURM time limit shorter than a checkpoint are one line each with file:line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.jobs.spec.checkpoint_check import checkpoint_seconds
from xffl.jobs.spec.load import load_job
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec, RoundCheckpointSpec
from xffl.training.memory_model import model_parts

SLURM_PROFILE = {
    "name": "cluster",
    "connector": {"type": "ssh", "host": "login.example.org", "user": "me"},
    "slurm": {"partition": "batch", "time": "00:03:00"},
    "launcher": "srun",
}


def write_job(tmp_path: Path, checkpoint: dict[str, object], preset: str = "llama3.1-8b",
              slurm: bool = False) -> Path:
    """The quickstart with ``model.preset`` and ``training.checkpoint``; site alpha on a SLURM
    profile with a 3-minute limit when ``slurm``."""
    data = yaml.safe_load(QUICKSTART.read_text())
    data["model"] = {"preset": preset}
    data["training"]["checkpoint"] = checkpoint
    if slurm:
        (tmp_path / "site_profiles").mkdir()
        (tmp_path / "site_profiles" / "cluster.yaml").write_text(yaml.safe_dump(SLURM_PROFILE))
        data["sites"][0]["profile"] = "cluster"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    return job


def line_of(job: Path, text: str) -> int:
    return next(i for i, ln in enumerate(job.read_text().splitlines(), 1) if text in ln)


def validate(job: Path) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, ["validate", str(job)])
    return result.exit_code, [ln.removeprefix("error: ") for ln in result.output.splitlines()
                              if str(job) in ln]


def test_every_shorter_than_a_checkpoint(tmp_path: Path) -> None:
    job = write_job(tmp_path, {"every": "2m", "keep": 2})
    cost = checkpoint_seconds(model_parts(build_config(ModelSpec(preset="llama3.1-8b"))).total)
    assert cost > 120  # 8 B parameters x 12 bytes: the estimate is minutes, not seconds
    code, lines = validate(job)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        f"{job}:{line_of(job, 'every:')}: job spec field training.checkpoint.every: every 2m "
        "is shorter than a checkpoint"), lines
    # in steps, or long enough, or a model whose checkpoint is fast: accepted
    for every in (50, f"{int(cost // 60) + 1}m"):
        assert load_job(write_job(tmp_path, {"every": every})).spec.training.checkpoint
    assert load_job(write_job(tmp_path, {"every": "1m"}, preset="tiny"))


def test_keep_zero(tmp_path: Path) -> None:
    job = write_job(tmp_path, {"every": 10, "keep": 0})
    code, lines = validate(job)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        f"{job}:{line_of(job, 'keep:')}:") and "keep at least 1 checkpoint" in lines[0], lines


def test_slurm_time_limit_shorter_than_a_checkpoint(tmp_path: Path) -> None:
    job = write_job(tmp_path, {"every": 100}, slurm=True)
    code, lines = validate(job)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        f"{job}:{line_of(job, 'profile: cluster')}: job spec field sites[0].profile: site "
        "'alpha''s SLURM time limit 00:03:00 (180 s) is shorter than one checkpoint"), lines


def test_every_is_steps_or_minutes() -> None:
    assert RoundCheckpointSpec(every=25).every_steps == 25
    spec = RoundCheckpointSpec(every="1.5m")
    assert (spec.every_steps, spec.every_seconds, spec.keep) == (None, 90.0, 2)
    for bad in (0, -3, True, "30", "0m", "m", "30s", 2.5):
        with pytest.raises(ValidationError, match="write a number of optimizer steps"):
            RoundCheckpointSpec(every=bad)


def test_chained_round_time_limit_shorter_than_a_checkpoint_and_its_margin(
        tmp_path: Path) -> None:
    """training.checkpoint.chain: a job must fit one checkpoint and the margin it stops in
    (the tiny model: 1 s + 2 x 1 s + 60 s = 64 s). A 60 s limit fits the checkpoint (accepted
    without chain) but not the margin: one line with file:line, exit 2; 00:01:05 is enough."""
    job = write_job(tmp_path, {"every": 10, "chain": True}, preset="tiny", slurm=True)
    profile = tmp_path / "site_profiles" / "cluster.yaml"
    for limit, ok in (("00:01:00", False), ("00:01:05", True)):
        profile.write_text(yaml.safe_dump({**SLURM_PROFILE, "slurm": {
            "partition": "batch", "time": limit}}))
        code, lines = validate(job)
        assert (code == 0) == ok, lines
        if not ok:
            assert code == 2 and len(lines) == 1 and lines[0].startswith(
                f"{job}:{line_of(job, 'profile: cluster')}: job spec field sites[0].profile: "
                "site 'alpha''s SLURM time limit 00:01:00 (60 s) is shorter than one checkpoint "
                "plus the 63 s margin a chained round saves in"), lines
            assert "give the site at least 65 s" in lines[0], lines
    job.write_text(job.read_text().replace("chain: true", "chain: false"))
    profile.write_text(yaml.safe_dump({**SLURM_PROFILE, "slurm": {"partition": "batch",
                                                                  "time": "00:01:00"}}))
    assert validate(job)[0] == 0  # one job per round: the checkpoint alone must fit
