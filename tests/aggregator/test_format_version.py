"""Every checkpoint names the xffl that wrote it and its exchange format's version; an update of
another format is rejected naming both formats and both xffl versions, whatever else its
manifest holds (another format's fields are not this one's), and the version a site writes
there is read as a site's word: bounded by a pattern, never echoed as it came."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xffl.aggregator.exchange import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    read_manifest,
    verify_checkpoint,
)
from xffl.aggregator.verify import UpdateRejected, check_update
from xffl.core.errors import CheckpointError
from xffl.core.versions import format_mismatch, same_format, xffl_version

TENSORS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _update(tmp_path: Path, write_ckpt: Any, **fields: Any) -> Path:
    """An honest update whose manifest.json then gets ``fields`` (None: the key removed)."""
    where = write_ckpt(tmp_path / "update", TENSORS, site="alpha")
    data = json.loads((where / MANIFEST_FILE).read_text())
    for key, value in fields.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (where / MANIFEST_FILE).write_text(json.dumps(data))
    return where


def test_a_checkpoint_records_the_xffl_that_wrote_it(tmp_path: Path, write_ckpt: Any) -> None:
    where = write_ckpt(tmp_path / "update", TENSORS, site="alpha")
    raw = json.loads((where / MANIFEST_FILE).read_text())
    assert raw["xffl_version"] == metadata.version("xffl") == xffl_version()
    assert raw["format_version"] == FORMAT_VERSION
    assert verify_checkpoint(where).xffl_version == xffl_version()
    assert check_update(where).xffl_version == xffl_version()


def test_the_comparison_is_of_whole_integers() -> None:
    assert same_format(FORMAT_VERSION)
    # JSON's true is Python's 1 == True, and 2.0 == 2: neither is a format version
    for other in (FORMAT_VERSION - 1, FORMAT_VERSION + 1, float(FORMAT_VERSION),
                  str(FORMAT_VERSION), True, None):
        assert not same_format(other), other


@pytest.mark.parametrize("version", [FORMAT_VERSION - 1, FORMAT_VERSION + 1])
def test_an_update_of_another_format_is_rejected_naming_both(
        tmp_path: Path, write_ckpt: Any, version: int) -> None:
    where = _update(tmp_path, write_ckpt, format_version=version, xffl_version="9.9.9")
    with pytest.raises(UpdateRejected) as caught:
        check_update(where)
    assert caught.value.site == "alpha"
    assert caught.value.reason == (
        f"format version {version} (written by xffl 9.9.9), where this xffl "
        f"{xffl_version()} reads format version {FORMAT_VERSION}")
    with pytest.raises(CheckpointError, match=f"format version {version} "):
        verify_checkpoint(where)


def test_a_later_formats_fields_do_not_hide_its_version(tmp_path: Path,
                                                         write_ckpt: Any) -> None:
    """A format this xffl does not know may hold fields it does not know: the refusal is
    still about the format (not 'invalid manifest'), and says which xffl wrote it."""
    where = _update(tmp_path, write_ckpt, format_version=FORMAT_VERSION + 1,
                    xffl_version="0.9.0", signature={"alg": "ed25519"})
    with pytest.raises(UpdateRejected) as caught:
        check_update(where)
    assert caught.value.reason.endswith(
        f"format version {FORMAT_VERSION + 1} (written by xffl 0.9.0), where this xffl "
        f"{xffl_version()} reads format version {FORMAT_VERSION}"), caught.value.reason
    assert "invalid manifest" not in caught.value.reason


def test_an_earlier_format_without_the_field_names_an_unknown_writer(
        tmp_path: Path, write_ckpt: Any) -> None:
    where = _update(tmp_path, write_ckpt, format_version=1, xffl_version=None)
    with pytest.raises(UpdateRejected, match=r"format version 1 \(written by xffl \?\)"):
        check_update(where)


@pytest.mark.parametrize("hostile", ["../../etc/passwd", "1" * 65, "0.1.0\n[ok] admitted",
                                     "", 1, ["0.1.0"]])
def test_a_version_that_is_not_one_is_refused_and_never_echoed(
        tmp_path: Path, write_ckpt: Any, hostile: Any) -> None:
    """Of this format: an invalid manifest (the field's name, not its text); of another: the
    format's refusal, with the version shown as ``?``."""
    where = _update(tmp_path, write_ckpt, xffl_version=hostile)
    with pytest.raises(UpdateRejected) as caught:
        check_update(where)
    assert "invalid manifest (xffl_version:" in caught.value.reason
    other = _update(tmp_path / "other", write_ckpt, format_version=FORMAT_VERSION + 1,
                    xffl_version=hostile)
    with pytest.raises(UpdateRejected) as caught:
        check_update(other)
    assert "(written by xffl ?)" in caught.value.reason
    if isinstance(hostile, str) and hostile:
        assert hostile not in caught.value.reason


def test_a_manifest_without_the_field_reads_as_an_unknown_writer(tmp_path: Path,
                                                                 write_ckpt: Any) -> None:
    """The field is optional to read (a checkpoint copied from elsewhere); writers set it."""
    where = _update(tmp_path, write_ckpt, xffl_version=None)
    assert read_manifest(where).xffl_version is None
    assert format_mismatch(FORMAT_VERSION, None).startswith(
        f"format version {FORMAT_VERSION} (written by xffl ?)")
