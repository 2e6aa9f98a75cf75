"""CLI: `xffl data prepare`, its --help example and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.schemas import check
from xffl.cli.app import app
from xffl.training.data import load_tokens, read_meta

runner = CliRunner()


def test_prepare_bytes_json(tmp_path: Path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("hello federated world\n")
    result = runner.invoke(app, ["data", "prepare", str(src), "-o", str(tmp_path / "d"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "d"
    assert json.loads(result.stdout) == {
        "out": str(out), "num_tokens": 22, "loss_tokens": 22, "examples": None,
        "vocab_size": 256, "dtype": "uint16", "inputs": 1, "validation_tokens": None,
        "skipped": None, "files": sorted(str(f) for f in out.iterdir())}
    assert {Path(f).name for f in json.loads(result.stdout)["files"]} >= {"meta.json"}
    assert bytes(load_tokens(tmp_path / "d").astype("uint8")) == b"hello federated world\n"


def test_prepare_validation_fraction_json(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"0123456789\n" * 10)  # 110 - floor(11.0) = 99, a line start: 11 bytes
    b.write_bytes(b"abc\n" * 5)  # 20 - floor(2.0) = 18, in the last line: the end, 0 bytes
    out = tmp_path / "d"
    result = runner.invoke(app, ["data", "prepare", str(a), str(b), "-o", str(out),
                                 "--validation-fraction", "0.1", "--json"])
    assert result.exit_code == 0, result.output
    summary = check("data-prepare", json.loads(result.stdout))
    assert (summary["num_tokens"], summary["validation_tokens"]) == (99 + 20, 11)
    assert summary["files"] == sorted(str(f) for f in out.iterdir() if f.name != "validation")
    assert bytes(load_tokens(out / "validation").astype("uint8")) == b"0123456789\n"
    assert bytes(load_tokens(out).astype("uint8")) == b"0123456789\n" * 9 + b"abc\n" * 5
    assert read_meta(out)["validation"] == {"fraction": 0.1, "num_tokens": 11,
                                            "path": "validation"}
    assert [s["tokens"] for s in read_meta(out / "validation")["sources"]] == [11, 0]
    plain = runner.invoke(app, ["data", "prepare", str(a), "-o", str(tmp_path / "p"),
                                "--validation-fraction", "0.1"])
    # on one line, however long the path (a terminal of 80 columns or not)
    assert plain.exit_code == 0 and \
        f"held out 11 tokens in {tmp_path / 'p' / 'validation'}\n" in plain.stdout


@pytest.mark.parametrize(("fraction", "message"), [
    ("0", "--validation-fraction must be between 0 and 1 (got 0.0); pass e.g. 0.05 to hold "
          "out 5%."),
    ("1", "--validation-fraction must be between 0 and 1 (got 1.0); pass e.g. 0.05 to hold "
          "out 5%."),
    ("-0.2", "--validation-fraction must be between 0 and 1 (got -0.2); pass e.g. 0.05 to "
             "hold out 5%."),
    ("0.01", "--validation-fraction 0.01 leaves no validation text; choose a fraction that "
             "leaves text on both sides."),
])
def test_prepare_bad_validation_fraction_exit_2(tmp_path: Path, fraction: str,
                                                message: str) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("hello federated world\n")
    result = runner.invoke(app, ["data", "prepare", str(src), "-o", str(tmp_path / "d"),
                                 "--validation-fraction", fraction])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {message}"]
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.txt"]


def test_prepare_bad_input_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["data", "prepare", str(tmp_path / "nope.txt"), "-o",
                                 str(tmp_path / "d")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such "
                                                  "file or folder; name existing inputs."]
    assert "Traceback" not in result.output and not (tmp_path / "d").exists()


def test_help_has_an_example() -> None:
    result = runner.invoke(app, ["data", "prepare", "--help"])
    assert result.exit_code == 0 and "xffl data prepare corpus/*.txt" in result.output
