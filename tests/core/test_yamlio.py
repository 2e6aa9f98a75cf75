"""YAML loading: line numbers of key paths and clear syntax errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from xffl.core.errors import InvalidInput
from xffl.core.yamlio import load_yaml


def test_lines_of_nested_keys(tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("name: x\nsites:\n  - name: a\n    data:\n      path: p\n")
    doc = load_yaml(f, "job spec")
    assert doc.line_of(("name",)) == 1
    assert doc.line_of(("sites", 0, "name")) == 3
    assert doc.line_of(("sites", 0, "data", "path")) == 5
    # a key that is missing falls back to its nearest existing parent
    assert doc.line_of(("sites", 0, "data", "nope")) == 4


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nrounds: [1, 2\n")
    with pytest.raises(InvalidInput) as info:
        load_yaml(f, "job spec")
    assert str(f) in info.value.message and "YAML syntax error" in info.value.message


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("name: x\nname: y\n")
    with pytest.raises(InvalidInput, match=r"dup.yaml:2: .*duplicate key 'name'"):
        load_yaml(f, "job spec")


def test_not_a_mapping(tmp_path: Path) -> None:
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(InvalidInput, match="must be a YAML mapping"):
        load_yaml(f, "job spec")


def test_a_merge_key_keeps_the_lines_as_written(tmp_path: Path) -> None:
    """One parse gives the lines and the data: the lines are read before the data is built,
    which flattens a merge key (``<<``) into its anchor's keys, in the node itself."""
    f = tmp_path / "merge.yaml"
    f.write_text("base: &b\n  x: 1\nsite:\n  <<: *b\n  y: 2\n")
    doc = load_yaml(f, "job spec")
    assert doc.data == {"base": {"x": 1}, "site": {"x": 1, "y": 2}}
    assert doc.lines == {(): 1, ("base",): 1, ("base", "x"): 2, ("site",): 3,
                         ("site", "<<"): 4, ("site", "y"): 5}
