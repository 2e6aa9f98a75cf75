"""The version probe, run by real Pythons: this venv's, one whose xffl is another version of
another exchange format, one without xffl; and a site's answer read as a site's words."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.site_profiles.other_xffl import other_xffl_python
from xffl.core.versions import FORMAT_VERSION, install_command, xffl_version
from xffl.site_profiles.versions import (
    MARKER,
    MAX_GPUS,
    format_problem,
    gres_of,
    parse_probe,
    probe_command,
    python_rows,
)


def _probe(python: str, full: bool = False) -> tuple[int, str, str]:
    proc = subprocess.run(["sh", "-c", probe_command(python, full)], capture_output=True,
                          text=True, timeout=300, check=False)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run where no xffl.egg-info lies (a checkout's root holds one: it would answer first)."""
    monkeypatch.chdir(tmp_path)


def test_this_pythons_answer_is_this_xffl() -> None:
    rc, out, _ = _probe(sys.executable, full=True)
    versions = parse_probe(out)
    assert rc == 0 and versions is not None, out
    assert versions.format == FORMAT_VERSION and versions.xffl == metadata.version("xffl")
    assert versions.torch == metadata.version("torch")
    assert versions.transformers == metadata.version("transformers")
    assert versions.error is None and versions.gpus is not None
    assert format_problem(sys.executable, versions, "here") is None
    rows, answer = python_rows(sys.executable, rc, out, "", "gpu:4", "p", "here")
    assert answer == versions
    names = [row[0] for row in rows]
    assert names == ["xffl importable", "versions", "exchange format", "gpus"]


def test_another_xffls_format_is_refused_naming_both(tmp_path: Path) -> None:
    python = str(other_xffl_python(tmp_path / "site dir"))  # a space: quoted in the fix
    rc, out, _ = _probe(python)
    versions = parse_probe(out)
    assert rc == 0 and versions is not None, out
    assert (versions.xffl, versions.format) == ("9.9.9", 99)
    assert format_problem(python, versions, "leonardo") == (
        f"its Python {python} has xffl 9.9.9, which writes exchange format 99, where this "
        f"xffl {xffl_version()} reads format {FORMAT_VERSION}; install this xffl "
        f"{xffl_version()} there: `xffl profiles install leonardo`")
    rows = {r[0]: r for r in python_rows(python, *_probe(python, full=True), None, None,
                                         "leonardo")[0]}
    assert rows["exchange format"][1] is False and rows["xffl importable"][1] is True
    assert "xffl 9.9.9 (exchange format 99)" in rows["versions"][2]


def test_a_python_without_xffl_is_told_how_to_install_it(tmp_path: Path) -> None:
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    bare.chmod(0o755)
    rc, out, _ = _probe(str(bare))
    versions = parse_probe(out)
    assert rc == 0 and versions is not None and versions.format is None, out
    problem = format_problem(str(bare), versions, "my-site")
    assert problem is not None and problem.startswith(
        f"its Python {bare} cannot import xffl (ModuleNotFoundError: No module named 'xffl')")
    assert problem.endswith(f"`{install_command('my-site')}`")
    assert install_command("my-site") == "xffl profiles install my-site"


def _line(**fields: object) -> str:
    base: dict[str, object] = {"python": "3.11.7", "xffl": "0.1.0", "format": FORMAT_VERSION}
    return MARKER + json.dumps({**base, **fields})


@pytest.mark.parametrize("out", [
    "", "xffl-versions", _line()[:-1], _line(format=True), _line(format=float(FORMAT_VERSION)),
    _line(format=str(FORMAT_VERSION)), _line(format=-1), _line(xffl="../../x"),
    _line(xffl="0.1.0\nadmitted"), _line(gpus=["A100\x1b[2J"]), _line(gpus=["x" * 101]),
    _line(gpus=["H100"] * (MAX_GPUS + 1)), _line(error="\x07" * 3), _line(extra="field"),
    _line(python="3" * 65), MARKER + "[1, 2]", _line(gpus=["A" * 100] * 64) + " " * 8192,
])
def test_an_answer_that_is_not_the_probes_is_none(out: str) -> None:
    assert parse_probe(out) is None


def test_the_last_marked_line_is_the_answer() -> None:
    """A login banner or a profile script's echo around it is ignored; a line a site's shell
    printed with the marker before the probe's own does not count."""
    out = f"Welcome to the cluster\n{_line(xffl='0.0.1')}\n{_line()}\nbye\n"
    versions = parse_probe(out)
    assert versions is not None and versions.xffl == "0.1.0"


def test_gres_is_short_and_printable() -> None:
    assert gres_of("gpu:a100:4(S:0-1)\ngpu:a100:4(S:0-1)\n(null)\n") == \
        "(null), gpu:a100:4(S:0-1)"
    many = gres_of("".join(f"gpu:{i}\x1b\n" for i in range(20)))
    assert "\x1b" not in many and many.endswith("(+12 more)")
