"""CLI: `xffl data prepare`, its --help example and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.training.data import load_tokens

runner = CliRunner()


def test_prepare_bytes_json(tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("hello federated world\n")
    result = runner.invoke(app, ["data", "prepare", str(src), "-o", str(tmp_path / "d"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "d"
    assert json.loads(result.stdout) == {
        "out": str(out), "num_tokens": 22, "vocab_size": 256, "dtype": "uint16", "inputs": 1,
        "files": sorted(str(f) for f in out.iterdir())}
    assert {Path(f).name for f in json.loads(result.stdout)["files"]} >= {"meta.json"}
    assert bytes(load_tokens(tmp_path / "d").astype("uint8")) == b"hello federated world\n"


def test_prepare_bad_input_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["data", "prepare", str(tmp_path / "nope.txt"), "-o",
                                 str(tmp_path / "d")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such "
                                                  "file; name existing text files."]
    assert "Traceback" not in result.output and not (tmp_path / "d").exists()


def test_help_has_an_example() -> None:
    result = runner.invoke(app, ["data", "prepare", "--help"])
    assert result.exit_code == 0 and "xffl data prepare corpus/*.txt" in result.output
