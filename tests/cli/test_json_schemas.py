"""Every command's --json output against its JSON Schema in docs/json/, through the real CLI.

The schemas are the documented contract: a field renamed, dropped or retyped in a command
fails here. Commands whose output needs a cluster or a real run (round, resume, schedule,
provenance, simulate, sites check, profiles install, submit --wait, report, validate,
evaluate) are checked where their tests run them.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from tests.aggregator.conftest import write_checkpoint
from tests.cli.schemas import SCHEMAS, check
from tests.cli.test_cancel_logs import _execution
from tests.cli.test_screens import RUN, finished_run  # noqa: F401  (a fixture)
from tests.conftest import QUICKSTART, REPO, FinishedRun
from xffl.cli.app import app

runner = CliRunner()

# command path -> the schema of its --json output
COMMANDS: dict[tuple[str, ...], str] = {
    ("submit",): "submit", ("status",): "status", ("watch",): "status", ("runs",): "runs",
    ("logs",): "logs", ("cancel",): "cancel", ("resume",): "resume", ("round",): "round",
    ("schedule",): "schedule", ("provenance",): "provenance", ("validate",): "validate",
    ("render",): "render", ("init",): "init", ("report",): "report",
    ("aggregate",): "aggregate", ("simulate",): "simulate", ("profiles", "list"): "profiles-list",
    ("profiles", "show"): "profiles-show", ("profiles", "check"): "profiles-check",
    ("profiles", "init"): "profiles-init", ("profiles", "install"): "profiles-install",
    ("data", "prepare"): "data-prepare",
    ("export",): "export", ("evaluate",): "evaluate",
    ("profiles", "image"): "profiles-image",
}


def _leaves(command: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    sub = getattr(command, "commands", None)
    if not sub:
        return {path: command}
    out: dict[tuple[str, ...], Any] = {}
    for name, child in sub.items():
        if not getattr(child, "hidden", False):  # `xffl sites`: profiles' old, hidden name
            out.update(_leaves(child, (*path, name)))
    return out


def test_every_json_command_has_a_schema() -> None:
    leaves = _leaves(typer.main.get_command(app))
    with_json = {p for p, c in leaves.items()
                 if any("--json" in getattr(o, "opts", ()) for o in c.params)}
    assert with_json == set(COMMANDS)
    documented = {p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")}
    assert documented == {*COMMANDS.values(), "error"}


def _json(argv: list[str], code: int = 0) -> Any:
    result = runner.invoke(app, argv)
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_the_outputs_of_a_run(finished_run: str, tmp_path: Path) -> None:  # noqa: F811
    check("status", _json(["status", "last", "--json", "--no-live"]))
    check("runs", _json(["runs", "--json"]))
    run_dir = Path(check("status", _json(["status", RUN, "--json", "--no-live"]))["run_dir"])
    check("logs", _json(["logs", RUN, "--json"]))
    (run_dir / "streamflow.log").write_text(
        _execution("karolina", "/rounds/train_karolina/0.0", 1, "/tmp/x/k1"))
    check("logs", _json(["logs", RUN, "--site", "karolina", "--json"]))
    check("status", _json(["watch", RUN, "--json"]))


def test_the_outputs_of_a_waiting_run(xffl_home: Path, tmp_path: Path) -> None:
    run_id = check("submit", _json(["submit", str(QUICKSTART), "--no-start", "--json"]))[
        "run_id"]
    check("cancel", _json(["cancel", run_id, "--json"]))
    check("status", _json(["watch", run_id, "--json"], code=1))  # cancelled: exit 1
    check("render", _json(["render", str(QUICKSTART), "-o", str(tmp_path / "plan"),
                           "--no-init-model", "--json"]))
    check("init", _json(["init", str(tmp_path / "demo"), "--json"]))


def test_the_outputs_about_profiles_data_and_checkpoints(xffl_home: Path,
                                                         tmp_path: Path) -> None:
    check("profiles-list", _json(["profiles", "list", "--json"]))
    check("profiles-show", _json(["profiles", "show", "local", "--json"]))
    check("profiles-init", _json(["profiles", "init", "lumi", "--json"]))
    text = tmp_path / "corpus.txt"
    text.write_text("the data never leaves the site\n" * 50)
    check("data-prepare", _json(["data", "prepare", str(text), "-o", str(tmp_path / "tok"),
                                 "--json"]))
    t = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    ups = [str(write_checkpoint(tmp_path / s, t, site=s)) for s in ("alpha", "beta")]
    check("aggregate", _json(["aggregate", "-o", str(tmp_path / "g"), *ups, "--json"]))


@pytest.mark.parametrize("argv", [
    ["status", "nope"], ["watch", "nope"], ["logs", "nope"], ["report", "nope"],
    ["cancel", "nope"], ["resume", "nope"], ["round", "nope"], ["provenance", "nope"],
    ["schedule", "nope", "--remove"], ["validate", "missing.yaml"], ["submit", "missing.yaml"],
    ["render", "missing.yaml", "-o", "plan"], ["simulate", "missing.yaml", "--sites", "2"],
    ["aggregate", "-o", "g", "nowhere"], ["export", "nope", "-o", "x"], ["evaluate", "nope"],
    ["profiles", "show", "nowhere"],
    ["profiles", "check", "nowhere"], ["profiles", "init", "nowhere"],
    ["data", "prepare", "missing.txt", "-o", "tok"]],
    ids=lambda argv: "-".join(a for a in argv if not a.endswith((".yaml", ".txt"))))
def test_an_error_under_json_is_the_error_object(xffl_home: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 argv: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    error = check("error", _json([*argv, "--json"], code=2))["error"]
    assert error["code"] == 2 and error["kind"] == "invalid_input"


def test_the_wheel_ships_every_schema(quickstart_run: FinishedRun) -> None:
    """A user of the wheel has no clone: the schemas of docs/json/ come with xffl, as the
    package xffl.cli.schemas (issue 31 item 12)."""
    venv = quickstart_run.home.parent / "venv"
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from importlib.resources import files; "
         "print('\\n'.join(sorted(p.name for p in files('xffl.cli.schemas').iterdir() "
         "if p.name.endswith('.json'))))"],
        capture_output=True, text=True, timeout=60, check=True, cwd=quickstart_run.home)
    shipped = done.stdout.split()
    assert shipped == sorted(p.name for p in (REPO / "docs" / "json").glob("*.schema.json"))
    assert "status.schema.json" in shipped and "error.schema.json" in shipped
