"""What people expect of any command-line program: --version, -h, --debug anywhere, pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry

runner = CliRunner()
XFFL = str(Path(sys.executable).parent / "xffl")


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"xffl {version('xffl')}\n"


@pytest.mark.parametrize("argv", [["-h"], ["status", "-h"], ["profiles", "list", "-h"]])
def test_dash_h_is_help(argv: list[str]) -> None:
    result = runner.invoke(app, argv)
    long = runner.invoke(app, [*argv[:-1], "--help"])
    assert result.exit_code == 0 and "Usage:" in result.stdout
    assert result.stdout == long.stdout


def test_shell_completion_is_offered() -> None:
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


def test_debug_after_the_subcommand(xffl_home: Path) -> None:
    """``--debug`` works where users put it: after the command, as before it."""
    quiet = runner.invoke(app, ["status", "nope"])
    assert quiet.exit_code == 2 and "Traceback" not in quiet.stderr
    for argv in (["--debug", "status", "nope"], ["status", "nope", "--debug"],
                 ["status", "--debug", "nope"]):
        loud = runner.invoke(app, argv)
        assert loud.exit_code == 2, argv
        assert "Traceback (most recent call last)" in loud.stderr, argv
        assert "error: there are no runs yet" in loud.stderr or "no run 'nope'" in loud.stderr
    # after `--`, --debug is an argument, not the option
    assert runner.invoke(app, ["status", "--", "--debug"]).exit_code == 2


@pytest.mark.parametrize("argv", [["status", "last"], ["status", "last", "--json"], ["runs"],
                                  ["profiles", "list"]])
def test_a_reader_that_stops_early_is_no_failure(xffl_home: Path, argv: list[str]) -> None:
    """``xffl status | head -1``: the reader closed the pipe; the command exits 0, silently."""
    assert runner.invoke(app, ["submit", str(QUICKSTART), "--no-start"]).exit_code == 0
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: every write is EPIPE
    with os.fdopen(write, "wb") as out:
        done = subprocess.run([XFFL, *argv], stdout=out, stderr=subprocess.PIPE, text=True,
                              timeout=120, env=os.environ)
    assert (done.returncode, done.stderr) == (0, "")


def test_the_pipe_reader_gets_the_output(xffl_home: Path) -> None:
    """The same command into a reader that stays: the whole output (no exit on a short pipe)."""
    assert runner.invoke(app, ["submit", str(QUICKSTART), "--no-start"]).exit_code == 0
    done = subprocess.run([XFFL, "status", "last", "--json"], capture_output=True, text=True,
                          timeout=120, env=os.environ, check=True)
    assert json.loads(done.stdout)["state"] == "waiting"


@pytest.mark.parametrize(("argv", "code", "kind"), [
    (["status", "--json"], 2, "invalid_input"),  # no runs yet
    (["logs", "nope", "--json"], 2, "invalid_input"),
    (["profiles", "show", "nowhere", "--json"], 2, "invalid_input"),
])
def test_errors_under_json_are_json_on_stdout(xffl_home: Path, argv: list[str], code: int,
                                              kind: str) -> None:
    """A script that reads stdout reads JSON, error or not; people still read stderr."""
    result = runner.invoke(app, argv)
    assert result.exit_code == code, result.output
    error = json.loads(result.stdout)["error"]
    assert (error["code"], error["kind"]) == (code, kind)
    assert error["lines"][0] == error["message"] and error["message"] in result.stderr


def test_an_internal_error_is_exit_5_with_one_line(xffl_home: Path) -> None:
    """A state xffl cannot read (its registry overwritten by something else) is exit 5: one
    line naming the failure and --debug, no traceback, the error object under --json."""
    from xffl.core.paths import registry_path

    registry_path().parent.mkdir(parents=True, exist_ok=True)
    registry_path().write_bytes(b"not a SQLite database, " * 100)
    plain = subprocess.run([XFFL, "runs"], capture_output=True, text=True, timeout=120,
                           env=os.environ)
    assert plain.returncode == 5, plain.stderr
    assert plain.stderr.startswith("internal error: DatabaseError: file is not a database")
    assert "--debug" in plain.stderr and "Traceback" not in plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1
    as_json = runner.invoke(app, ["runs", "--json"])
    assert as_json.exit_code == 5
    assert json.loads(as_json.stdout)["error"]["kind"] == "internal"


def test_options_from_the_environment(xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """XFFL_JSON, XFFL_DEBUG and XFFL_<COMMAND>_<OPTION> set options; the command line wins."""
    run_id = json.loads(runner.invoke(app, ["submit", str(QUICKSTART), "--no-start",
                                            "--json"]).stdout)["run_id"]
    monkeypatch.setenv("XFFL_JSON", "1")
    assert json.loads(runner.invoke(app, ["status"]).stdout)["run_id"] == run_id
    monkeypatch.setenv("XFFL_WATCH_TIMEOUT", "-1")  # checked as the option is
    refused = runner.invoke(app, ["watch"])
    assert refused.exit_code == 2 and "--timeout" in refused.stderr
    assert "nothing runs it" in runner.invoke(app, ["watch", "--timeout", "0"]).stderr
    monkeypatch.setenv("XFFL_DEBUG", "1")
    loud = runner.invoke(app, ["status", "nope"])
    assert loud.exit_code == 2 and "Traceback" in loud.stderr
    assert json.loads(loud.stdout)["error"]["kind"] == "invalid_input"  # XFFL_JSON
    monkeypatch.setenv("XFFL_SUBMIT_TIMEOUT", "-1")  # checked as the option is
    assert runner.invoke(app, ["submit", str(QUICKSTART), "--wait"]).exit_code == 2
    assert Registry().list_runs()[0].id == run_id  # nothing submitted


@pytest.mark.parametrize("name, value", [
    ("XFFL_VERSION", "0.1.0"), ("XFFL_VERSION", "1"), ("XFFL_INSTALL_COMPLETION", "1"),
    ("XFFL_SHOW_COMPLETION", "1"), ("XFFL_HELP", "1"), ("XFFL_RUNS_HELP", "1"),
    ("XFFL_PROFILES_HELP", "1"), ("XFFL_PROFILES_LIST_HELP", "1")])
def test_only_command_options_read_the_environment(
        xffl_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
        value: str) -> None:
    """The root's options (--version, --install-completion, --show-completion) and --help are
    not options of a command: ``XFFL_<NAME>`` sets none of them (issue 31, item 8)."""
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SHELL", "/bin/bash")
    monkeypatch.setenv(name, value)
    argv = ["profiles", "list", "--json"] if "PROFILES" in name else ["runs", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert isinstance(json.loads(result.stdout), list)  # the command ran, nothing else
    assert list(home.iterdir()) == []  # no completion script, no ~/.bashrc


@pytest.mark.parametrize("command", ["status", "simulate", "aggregate"])
def test_help_in_a_pipe_is_plain_text(command: str) -> None:
    """No panels, no padding, paragraphs re-wrapped (docstring line breaks left no stray
    `+` or `1` lines), and arguments named as the docs name them."""
    done = subprocess.run([XFFL, command, "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "80"}, check=True)
    lines = done.stdout.splitlines()
    assert all(line == line.rstrip() and len(line) <= 80 for line in lines)
    assert not any(ch in done.stdout for ch in "╭│╰")
    assert not [line for line in lines if line.strip() in {"+", "1"}]
    usage = {"status": "[RUN]", "simulate": "JOB", "aggregate": "[UPDATE]..."}[command]
    assert lines[0] == f"Usage: xffl {command} [OPTIONS] {usage}"  # JOB, not Typer's {JOB}


def test_no_usage_line_has_braces() -> None:
    """Every command of the tree names its arguments as click and man pages do."""
    import typer

    def leaves(cmd: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        sub = getattr(cmd, "commands", None)
        return [x for name, c in (sub or {}).items() for x in leaves(c, (*path, name))] \
            if sub else [(path, cmd)]

    found = leaves(typer.main.get_command(app), ())
    assert len(found) >= 20
    for path, _cmd in found:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        usage = result.stdout.splitlines()[0]
        assert usage.startswith(f"Usage: xffl {' '.join(path)} ") and "{" not in usage, usage


def test_every_option_reads_xffl_command_option() -> None:
    """The environment name of every command option is ``XFFL_<COMMAND>_<OPTION>``, the
    option's first long name (``XFFL_LOGS_ROUND`` for ``--round``, never the Python name
    ``XFFL_LOGS_RND``), as docs/cli.md says (issue 31 item 12)."""
    import typer

    def leaves(cmd: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
        sub = getattr(cmd, "commands", None)
        return [x for name, c in (sub or {}).items() for x in leaves(c, (*path, name))] \
            if sub else [(path, cmd)]

    wrong, seen = [], 0
    for path, cmd in leaves(typer.main.get_command(app), ()):
        prefix = "XFFL_" + "_".join(path).upper().replace("-", "_")
        for param in cmd.params:
            if param.param_type_name != "option" or param.envvar or not param.allow_from_autoenv:
                continue
            seen += 1
            first = next(o for o in param.opts if o.startswith("--"))
            want = f"{prefix}_{first[2:].upper().replace('-', '_')}"
            if f"{prefix}_{param.name.upper()}" != want:
                wrong.append(f"{' '.join(path)} {first}: {prefix}_{param.name.upper()}")
    assert seen > 50 and wrong == []


@pytest.mark.parametrize("argv, env", [
    (["status", "--json", "--bogus"], {}), (["watch", "--timeout=-2"], {"XFFL_JSON": "1"}),
    (["profiles", "list", "--json", "--x"], {}), (["nosuch", "--json"], {}),
    (["aggregate", "--json"], {})])
def test_usage_errors_under_json_are_json_on_stdout(argv: list[str], env: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Click's own usage errors (an unknown option or command, a value out of range, a
    missing option) under --json or XFFL_JSON=1: exit 2, the error object on stdout and
    click's lines on stderr, as for every other error (issue 31 item 12)."""
    from tests.cli.schemas import check

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    error = check("error", json.loads(result.stdout))["error"]
    assert error["kind"] == "invalid_input" and error["message"] in result.stderr
    plain = runner.invoke(app, [a for a in argv if a != "--json"], env={"XFFL_JSON": ""})
    assert plain.exit_code == 2 and plain.stdout == ""


def test_help_examples_use_files_a_wheel_user_has() -> None:
    """examples/quickstart.yaml exists only in a clone; examples name demo/job.yaml, which
    `xffl init demo` writes (issue 31 item 12)."""
    for command in ("submit", "render", "validate", "simulate"):
        shown = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).stdout
        assert "examples/quickstart.yaml" not in shown and "demo/job.yaml" in shown, command
