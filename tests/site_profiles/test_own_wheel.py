"""xffl's own wheel is built from one place: the checkout that runs, refused with each
command's own fix when xffl runs from an installed wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

import xffl.core
from tests.conftest import REPO
from xffl.core.errors import InvalidInput
from xffl.site_profiles import own_wheel
from xffl.site_profiles.image import build_wheel
from xffl.site_profiles.pins import INSTALL_FIX, source_digest


def test_the_source_is_the_checkout_that_runs() -> None:
    assert own_wheel.source_dir("unused") == REPO


@pytest.fixture
def installed_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """xffl as if it ran from site-packages: its core package outside any checkout."""
    core = tmp_path / "site-packages" / "xffl" / "core"
    core.mkdir(parents=True)
    monkeypatch.setattr(xffl.core, "__file__", str(core / "__init__.py"))
    return tmp_path / "site-packages"


def test_profiles_image_outside_a_checkout_asks_for_the_wheel(installed_wheel: Path,
                                                             tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as err:
        build_wheel(tmp_path / "out")
    text = str(err.value)
    assert f"xffl runs from {installed_wheel / 'xffl'}, which is not a source checkout" in text
    assert text.endswith("pass --wheel PATH (the xffl wheel you installed)")
    assert not (tmp_path / "out").exists()


def test_profiles_install_outside_a_checkout_names_the_setup_script(installed_wheel: Path) -> None:
    source_digest.cache_clear()
    try:
        with pytest.raises(InvalidInput) as err:
            source_digest()
    finally:
        source_digest.cache_clear()
    assert str(err.value).endswith(INSTALL_FIX)
    assert "scripts/setup-venv.sh" in INSTALL_FIX
