"""One wording across the commands: `error:` for every error, usage errors included, and `DIR`
for a folder in every help text (never `FOLDER`), as the docs write it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from xffl.cli.app import app

runner = CliRunner()


def _commands(command: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every command and group under ``command`` (hidden aliases left out), with its path."""
    out = [(path, command)]
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        if not sub.hidden:
            out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(typer.main.get_command(app))


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "xffl")
def test_help_names_a_folder_dir_and_an_output_by_its_kind(path: tuple[str, ...]) -> None:
    result = runner.invoke(app, [*path, "-h"])
    assert result.exit_code == 0, result.output
    assert not re.search(r"\bFOLDERS?\b", result.stdout), result.stdout
    out = re.search(r"-o, --output, --out (\S+)", result.stdout)
    if out is not None:  # a folder everywhere but provenance's crate file
        assert out.group(1) == ("FILE" if path == ("provenance",) else "DIR"), result.stdout


@pytest.mark.parametrize("path", [p for p, _ in COMMANDS], ids=lambda p: " ".join(p) or "xffl")
def test_a_usage_error_reads_as_every_other_error(path: tuple[str, ...]) -> None:
    """`error: ...` as handle_errors writes it (click's own is `Error: ...`), after the usage
    line and its help hint; exit 2."""
    result = runner.invoke(app, [*path, "--no-such-option"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0].startswith(f"Usage: xffl {' '.join(path)}".rstrip()), lines
    assert lines[-1].startswith("error: No such option: --no-such-option"), lines
    assert "Error" not in result.stderr


def test_a_missing_argument_reads_the_same() -> None:
    result = runner.invoke(app, ["render"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "error: Missing argument 'JOB'."
