"""CLI: validate and render, the examples of their --help, and exit codes on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()


def test_validate_quickstart_ok() -> None:
    result = runner.invoke(app, ["validate", str(QUICKSTART), "--json"])
    assert result.exit_code == 0, result.output
    assert check("validate", json.loads(result.stdout)) == {
        "valid": True, "job": str(QUICKSTART.resolve()), "rounds": 3,
        "sites": [{"site": site, "profile": "local", "ranks": 2, "layout": "ddp dp 2 x tp 1",
                   "estimate_gib": 0.009, "phase": "forward/backward", "gpus_per_node": None,
                   "gpu_memory_gib": None, "fits": None, "fix": None}
                  for site in ("alpha", "beta")],
        "warnings": []}


def test_validate_three_errors_exit_2_one_line_each(tmp_path: Path, xffl_home: Path) -> None:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["rounds"] = "three"                 # wrong type
    data["training"]["stepz"] = 3            # unknown key
    data["sites"][1]["profile"] = "nowhere"  # missing profile
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump(data, sort_keys=False))
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, result.stderr
    assert all(str(job) in e for e in errors)
    assert any("job spec field rounds:" in e for e in errors)
    assert any("training.stepz: unknown key 'stepz'; did you mean 'steps'?" in e for e in errors)
    assert any("sites[1].profile: site profile 'nowhere' not found" in e for e in errors)
    assert "Traceback" not in result.output
    assert not (xffl_home / "runs").exists()


def test_submit_bad_spec_leaves_nothing(tmp_path: Path, xffl_home: Path) -> None:
    job = tmp_path / "bad.yaml"
    job.write_text("name: x\nrounds: 0\nsites: []\n")
    result = runner.invoke(app, ["submit", str(job)])
    assert result.exit_code == 2
    assert not (xffl_home / "runs").exists()
    listing = runner.invoke(app, ["runs", "--json"])
    assert listing.exit_code == 0 and listing.stdout.strip() == "[]"


def test_missing_job_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "job spec not found" in result.stderr


def test_render_writes_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(QUICKSTART), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert (out / "main.cwl").is_file() and (out / "streamflow.yml").is_file()
    again = runner.invoke(app, ["render", str(QUICKSTART), "-o", str(out)])
    assert again.exit_code == 2 and "not empty" in again.stderr and "--force" in again.stderr
    (out / "stale.txt").write_text("from an earlier plan")
    first = json.loads(result.stdout)["run_id"]
    forced = runner.invoke(app, ["render", str(QUICKSTART), "--output", str(out), "--force",
                                 "--no-init-model", "--json"])
    assert forced.exit_code == 0, forced.output
    assert not (out / "stale.txt").exists() and (out / "main.cwl").is_file()
    assert json.loads(forced.stdout)["run_id"] != first  # a new plan, not a merge


def test_every_output_option_is_spelled_the_same() -> None:
    """-o, --output (and the older --out) wherever a command writes somewhere chosen."""
    import typer.main

    from xffl.cli.app import app as full

    def leaves(cmd: object) -> list[object]:
        sub = getattr(cmd, "commands", None)
        return [leaf for c in sub.values() for leaf in leaves(c)] if sub else [cmd]

    outs = [p.opts for c in leaves(typer.main.get_command(full)) for p in c.params
            if "-o" in p.opts]
    # render, report, provenance, export, aggregate, simulate, data prepare, profiles image
    # (and its hidden alias, sites image)
    assert len(outs) == 9 and all(sorted(o) == ["--out", "--output", "-o"] for o in outs)


def test_every_command_help_has_an_example() -> None:
    for cmd in ["submit", "status", "runs", "render", "validate", "aggregate", "cancel", "logs"]:
        result = runner.invoke(app, [cmd, "--help"])
        assert result.exit_code == 0
        assert "Example: xffl " + cmd in result.output
