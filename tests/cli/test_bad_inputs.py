"""The bad-input corpus (tests/cli/bad_inputs/): every case exits 2 with one clear line.

Each case is a folder: ``job.yaml`` (and, for profile cases, ``site_profiles/NAME.yaml``
next to it) plus ``expect.yaml``: the ``file`` the error line must name, the ``field`` path
(or the ``line``), and a regex ``match``; ``job`` overrides the path given to the command.
Cron cases hold a ``cron`` expression instead and go through ``validate_cron``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.core.errors import ExitCode, InvalidInput
from xffl.jobs.registry.store import Registry
from xffl.jobs.spec.cron import validate_cron

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
runner = CliRunner()


def _expect(case: Path) -> dict[str, Any]:
    data = yaml.safe_load((case / "expect.yaml").read_text())
    assert isinstance(data, dict) and "match" in data, case
    return data


CASES = sorted(p for p in CORPUS.iterdir() if p.is_dir())
JOB_CASES = [p for p in CASES if "cron" not in _expect(p)]
CRON_CASES = [p for p in CASES if "cron" in _expect(p)]

VALID_BASE = """name: good
rounds: 2
sites:
  - name: alpha
    profile: local
    ranks: 2
    data:
      path: data/alpha
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _nothing_left(home: Path) -> None:
    """No run directory and no registry row."""
    runs = home / "runs"
    assert not runs.exists() or not any(runs.iterdir()), _files(runs)
    registry = home / "registry.db"
    if registry.exists():
        assert Registry(registry).list_runs() == []


def test_corpus_is_big_and_covers_every_category() -> None:
    assert len(CASES) >= 40
    categories = {_expect(p)["category"] for p in CASES}
    assert categories >= {"yaml", "types", "unknown", "missing", "profiles", "model",
                          "injection", "cron"}
    assert len(CRON_CASES) >= 3


def test_the_base_of_the_corpus_is_valid(tmp_path: Path) -> None:
    """The cases are small edits of this spec, so each fails for its own reason only."""
    job = tmp_path / "job.yaml"
    job.write_text(VALID_BASE)
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["validate", "submit"])
@pytest.mark.parametrize("case", JOB_CASES, ids=lambda p: p.name)
def test_bad_input_exits_2_with_one_line(case: Path, command: str, tmp_path: Path,
                                         xffl_home: Path) -> None:
    work = tmp_path / case.name
    shutil.copytree(case, work)
    expect = _expect(work)
    before = _files(work)
    result = runner.invoke(app, [command, str(work / expect.get("job", "job.yaml"))])
    everything = result.output + result.stderr
    assert "Traceback" not in everything
    assert result.exit_code == ExitCode.INVALID_INPUT, everything
    assert result.stdout.strip() == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: ")
    named = (work / expect["file"]).resolve()
    assert str(named) in line
    if expect.get("line") is not None:
        assert f"{named}:{expect['line']}: " in line
    if expect.get("field") is not None:
        assert f" field {expect['field']}: " in line
    assert re.search(expect["match"], line), line
    _nothing_left(xffl_home)
    assert _files(work) == before


@pytest.mark.parametrize("case", CRON_CASES, ids=lambda p: p.name)
def test_bad_cron_expression(case: Path) -> None:
    expect = _expect(case)
    with pytest.raises(InvalidInput) as info:
        validate_cron(expect["cron"])
    assert info.value.exit_code == ExitCode.INVALID_INPUT
    assert info.value.lines == [info.value.message]
    assert "\n" not in info.value.message
    assert info.value.message.startswith(f"cron expression {expect['cron']!r}: ")
    assert "use five fields like '*/30 * * * *'" in info.value.message
    assert re.search(expect["match"], info.value.message), info.value.message


@pytest.mark.parametrize("expr", ["*/30 * * * *", "0 3 * * mon-fri", "@hourly", " 5  4 * * * "])
def test_good_cron_expressions(expr: str) -> None:
    assert validate_cron(expr) == " ".join(expr.split())


@pytest.mark.parametrize("name", ["x; rm -rf /", "$(id)", "Run", "../x", ""])
def test_submit_refuses_a_run_name_that_could_inject(tmp_path: Path, xffl_home: Path,
                                                     name: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(VALID_BASE)
    result = runner.invoke(app, ["submit", str(job), "--name", name])
    assert result.exit_code == ExitCode.INVALID_INPUT, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--name" in lines[0] and "not a valid run name" in lines[0]
    _nothing_left(xffl_home)
