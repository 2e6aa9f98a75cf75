"""`xffl profiles install` writes the profile's python: in place, the file's comments and
every other line kept, the value read back as written."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xffl.site_profiles.install_spec import InstallSpec
from xffl.site_profiles.profile_edit import set_top_level
from xffl.site_profiles.site_python import SitePython

PROFILE = """# CINECA Leonardo: fill in every YOUR_... value
name: leonardo
# python is used as given (no ~ or $HOME expansion)
python: /path/to/YOUR_VENV/bin/python   # the venv
install:
  python: python3   # the module's
workdir: /scratch/xffl
"""


def test_python_is_replaced_with_its_comments_kept(tmp_path: Path) -> None:
    path = tmp_path / "leonardo.yaml"
    path.write_text(PROFILE)
    path.chmod(0o600)
    set_top_level(path, "python", "/scratch/xffl/xffl-venvs/current/bin/python")
    assert path.read_text() == PROFILE.replace(
        "python: /path/to/YOUR_VENV/bin/python   # the venv",
        "python: /scratch/xffl/xffl-venvs/current/bin/python   # the venv")
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("value", ["/a b/#c/python", "/x: y/python", "/plain/python"])
def test_a_missing_python_is_added_and_reads_back(tmp_path: Path, value: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nworkdir: /w  # here\n")
    set_top_level(path, "python", value)
    assert yaml.safe_load(path.read_text()) == {"name": "p", "workdir": "/w", "python": value}
    assert "# here" in path.read_text()


def test_the_sites_platforms_are_its_glibcs_manylinux_tags() -> None:
    answer = SitePython(version="3.11", full="3.11.7", implementation="cpython",
                        machine="aarch64", system="linux", libc="glibc-2.28")
    tags = answer.platforms()
    assert tags[0] == "manylinux_2_28_aarch64" and tags[-1] == "manylinux1_aarch64"
    assert "manylinux_2_17_aarch64" in tags and "manylinux_2_29_aarch64" not in tags


@pytest.mark.parametrize("field", ["index_url", "torch"])
def test_an_index_is_a_url(field: str) -> None:
    with pytest.raises(ValueError, match="is not an index URL"):
        InstallSpec.model_validate({field: "pypi.org simple"})
    assert getattr(InstallSpec.model_validate({field: "https://x.org/simple"}), field)
