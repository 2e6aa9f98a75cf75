"""The type checker sees across xffl's packages: a wrong argument to another package is caught.

mypy runs on the same symlinked ``xffl/`` tree as ``scripts/typecheck.sh`` builds (folders
from pyproject's package-dir, listed by ``scripts/packages.py``), with the project's strict
configuration, on two small modules outside the package that call into it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PROBES = {
    "good": "from xffl.aggregator.robust import cap_shares\n\n"
            "shares: list[float] = cap_shares([3.0, 1.0], 0.5)\n",
    # a str where the aggregator wants weights: only visible if mypy resolves xffl.aggregator
    "bad": "from xffl.aggregator.robust import cap_shares\n\n"
           "shares: list[float] = cap_shares(\"not weights\", 0.5)\n",
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typecheck")
    folders = subprocess.run([sys.executable, str(REPO / "scripts" / "packages.py")],
                             capture_output=True, text=True, check=True).stdout.split()
    assert "aggregator" in folders and "cli" in folders
    (root / "xffl").mkdir()
    for folder in folders:
        (root / "xffl" / folder).symlink_to(REPO / folder)
    return root


def _mypy(tree: Path, probe: Path) -> subprocess.CompletedProcess[str]:
    mypy = Path(sys.executable).with_name("mypy")
    return subprocess.run([str(mypy), "--config-file", str(REPO / "pyproject.toml"),
                           "--cache-dir", str(REPO / ".mypy_cache"), str(probe)],
                          cwd=tree, env={**os.environ, "MYPYPATH": str(tree)},
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("case", ["good", "bad"])
def test_a_cross_package_call_is_type_checked(tree: Path, case: str) -> None:
    probe = tree / f"probe_{case}.py"
    probe.write_text(PROBES[case])
    done = _mypy(tree, probe)
    if case == "good":
        assert done.returncode == 0, done.stdout
    else:
        assert done.returncode == 1, done.stdout
        assert 'Argument 1 to "cap_shares" has incompatible type "str"' in done.stdout
