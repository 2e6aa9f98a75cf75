"""Shared fixtures: an isolated XFFL_HOME per test, and the real two-cluster test stack."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "jobs" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def xffl_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own data directory, registry and config dir."""
    home = tmp_path / "xffl-home"
    monkeypatch.setenv("XFFL_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return home


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests of state the whole machine shares (the crontab: ``serial``) run in one worker;
    tests of the SLURM stack are marked ``stack`` (``-m "not stack"`` leaves them out).

    Every pytest-xdist worker has its own SLURM stack (tests/stack/fixtures.py).
    """
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group("machine"))
        if "slurm_stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.stack)


from tests.stack.fixtures import slurm_stack  # noqa: E402, F401
