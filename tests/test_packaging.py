"""What the wheel ships: every package of the tree, and the starter jobs `xffl init` copies.

setuptools builds the wheel from pyproject.toml's explicit ``packages`` list; a sub-package
missing from it imports in a clone (the editable install finds it by folder) and is absent
from the wheel. The quickstart from the wheel (a slow test) catches that for what it runs;
this checks every package, fast.
"""

from __future__ import annotations

import sys
from fnmatch import fnmatch
from typing import Any

from tests.conftest import REPO
from xffl.cli.init import TEMPLATES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency there
    import tomli as tomllib


def _setuptools() -> dict[str, Any]:
    config: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"])


def test_every_folder_with_python_is_a_listed_package() -> None:
    tool = _setuptools()
    found = {".".join([name, *init.parent.relative_to(REPO / folder).parts])
             for name, folder in tool["package-dir"].items()
             for init in (REPO / folder).rglob("__init__.py")}
    assert len(found) > 10
    assert found - set(tool["packages"]) == set()


def test_the_starter_jobs_are_shipped_data() -> None:
    tool = _setuptools()
    folder = REPO / tool["package-dir"]["xffl.cli.examples"]
    patterns = tool["package-data"]["xffl.cli.examples"]
    assert "xffl.cli.examples" in tool["packages"]
    for spec_file, _ in TEMPLATES.values():
        assert (folder / spec_file).is_file(), spec_file
        assert any(fnmatch(spec_file, p) for p in patterns), spec_file
