"""Everything xffl writes under XFFL_HOME is its user's alone (a shared login node).

Updates and globals can leak training data, profiles name keys and carry environments:
after a real run (supervisor, StreamFlow, training processes, aggregate step, report) no
file or folder under XFFL_HOME grants anything to group or others, whatever the user's umask.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app

runner = CliRunner()


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The usual umask of a login shell (022): files would be world-readable by default."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.slow
def test_a_run_leaves_nothing_readable_by_others(tmp_path: Path, xffl_home: Path,
                                                 open_umask: None) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(name="private", rounds=1)
    spec["training"].update(steps=2, batch_size=2)
    for site in spec["sites"]:
        site["ranks"] = 1
        site["data"]["synthetic_sequences"] = 32
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300"])
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["id"]
    assert runner.invoke(app, ["report", run_id]).exit_code == 0
    os.umask(0o022)  # what the commands themselves set must not be what makes this pass
    paths = [xffl_home, *xffl_home.rglob("*")]
    kinds = {"global": False, "update": False, "registry": False, "profiles": False,
             "sites": False}
    for path in paths:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if not path.is_symlink():
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
        text = str(path.relative_to(xffl_home))
        kinds["global"] |= text.endswith("global/model.safetensors")
        kinds["update"] |= "/updates/" in text and text.endswith("model.safetensors")
        kinds["registry"] |= text == "registry.db"
        kinds["profiles"] |= text.endswith("profiles.json")
        kinds["sites"] |= text.startswith("sites/") and text.endswith(".bin")
    assert all(kinds.values()), kinds  # the walk saw every kind of file it is about
