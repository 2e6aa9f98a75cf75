"""Everything xffl writes under XFFL_HOME is its user's alone (a shared login node).

Updates and globals can leak training data, profiles name keys and carry environments:
after a real run (supervisor, StreamFlow, training processes, aggregate step, report) no
file or folder under XFFL_HOME grants anything to group or others, whatever the user's umask.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from tests.conftest import FinishedRun
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
def test_a_run_leaves_nothing_readable_by_others(quickstart_run: FinishedRun,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 open_umask: None) -> None:
    """The quickstart ran under umask 022 (tests/conftest.py); its report is written so too."""
    xffl_home = quickstart_run.home
    monkeypatch.setenv("XFFL_HOME", str(xffl_home))
    assert runner.invoke(app, ["report", quickstart_run.run_id]).exit_code == 0
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
