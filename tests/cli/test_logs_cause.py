"""`xffl logs` (issue 44 item 6): `logs -f` exits 0 after a completed run; the filter that hides
StreamFlow's and the supervisor's tracebacks (unless --debug) keeps every other line.

`xffl logs` of a real failed run (the cause first, per site; tracebacks hidden; `logs -f`
exits 1) is tested on the run tests/workflows/test_failure_policy.py makes fail (beta's data
promising a flags file that is not there), before it resumes it: one failed run for both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xffl.cli.app import app
from xffl.jobs.registry.store import Registry

runner = CliRunner()


def test_logs_follow_exits_0_after_a_completed_run(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """As `xffl watch`: a script's `xffl logs -f RUN && next-step` goes on after a completed
    run (1 after a failed one: tests/workflows/test_failure_policy.py)."""
    monkeypatch.setenv("XFFL_HOME", str(tmp_path / "home"))
    registry = Registry()
    registry.create_run("done-1", "done", tmp_path / "job.yaml", tmp_path, 1, ["alpha"])
    registry.set_state("done-1", "completed", "1 rounds completed")
    completed = runner.invoke(app, ["logs", "done-1", "-f"])
    assert completed.exit_code == 0, completed.output
    assert "cause" not in completed.stdout


def _formatted(raise_it: object) -> list[str]:
    """The lines Python's traceback module writes for what ``raise_it()`` raises."""
    import traceback

    try:
        raise_it()  # type: ignore[operator]
    except BaseException:
        return traceback.format_exc().splitlines()
    raise AssertionError("nothing raised")


def _chained() -> None:
    try:
        raise KeyError("inner")
    except KeyError as exc:
        raise ValueError("outer") from exc


def _group() -> None:
    import builtins

    group = builtins.ExceptionGroup  # type: ignore[attr-defined,unused-ignore]  # >= 3.11
    raise group("two", [ValueError("1"), TypeError("2")])


def test_without_tracebacks_keeps_every_other_line() -> None:
    """A print's chained traceback and an exception group's (Python's own text) each become
    one line naming what was raised; a logging record's traceback, however its exception's
    message runs on, becomes a note on the record, and the record repeated is said once."""
    from xffl.cli.logs_view import HIDDEN, without_tracebacks

    record = "2026-11-28 10:06:30,{:03d} ERROR    Cannot operate on a closed database."
    group = sys.version_info >= (3, 11)  # exception groups are 3.11's
    lines = (["supervisor started", *_formatted(_chained), "between",
              *(_formatted(_group) if group else []),
              record.format(1), *_formatted(_chained), "message on", record.format(2),
              *_formatted(_chained), record.format(3), "2026-11-28 10:06:31,000 INFO     end"])
    assert without_tracebacks(lines) == [
        "supervisor started", f"ValueError: outer {HIDDEN}", "between",
        *[f"ExceptionGroup: two (2 sub-exceptions) {HIDDEN}"] * group,
        f"{record.format(1)} {HIDDEN}",
        "  (the line above 1 more time)", record.format(3),
        "2026-11-28 10:06:31,000 INFO     end"]
    repeated = [record.format(i) for i in range(5)]
    assert without_tracebacks(repeated) == [record.format(0), "  (the line above 4 more times)"]
