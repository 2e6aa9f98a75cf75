"""The suite's grouping holds: tests that share a session fixture or the crontab run in one
pytest-xdist worker (tests/conftest.py marks them ``xdist_group``).

pytest 9.2 builds node ids from a field that pytest-xdist 3.8's ``--dist loadgroup`` does not
set (pytest-xdist#1386): the groups are then silently ignored, two workers each run the
shared quickstart, and crontab tests may run at once. A real ``pytest -n 2`` over a small
folder shows whether the installed pair honours the marks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFTEST = '''
import os, pytest

@pytest.fixture(scope="session")
def shared():
    with open(os.path.join(os.path.dirname(__file__), "setups"), "a") as fh:
        fh.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
'''
TESTS = '''
import pytest, time

@pytest.mark.xdist_group("one")
def test_{name}_a(shared):
    time.sleep(0.2)

@pytest.mark.xdist_group("one")
def test_{name}_b(shared):
    time.sleep(0.2)

def test_{name}_free():
    time.sleep(0.2)
'''


def test_a_group_runs_in_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in ("x", "y"):
        (tmp_path / f"test_{name}.py").write_text(TESTS.format(name=name))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "-q", str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:]
    # four tests of group "one" in two modules: one worker, so one set-up of the fixture
    assert (tmp_path / "setups").read_text().split() in (["gw0"], ["gw1"])
