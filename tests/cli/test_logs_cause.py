"""`xffl logs` of a failed run (issue 44 item 6): the cause first, per site, as `xffl status`
has it; StreamFlow's and the supervisor's tracebacks hidden unless --debug; `logs -f` exits
1 after a failed run, 0 after a completed one.

The failed run is real: the quickstart on two local sites, beta's data promising a flags file
that is not there (a prepare that did not finish: `xffl submit` checks the tokens, not the
flags), so beta's trainer exits 2, the round has one valid update of the two it needs, and the
run fails; StreamFlow then logs its own tracebacks as it shuts down.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.cli.schemas import check
from tests.conftest import QUICKSTART
from tests.workflows.site_data import write_shards
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.registry.store import Registry

runner = CliRunner()


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:
    """(its XFFL_HOME, its `xffl status --json`) of a run that failed in round 1."""
    where = tmp_path_factory.mktemp("failed-run")
    home = where / "xffl-home"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XFFL_HOME", str(home))
        env.setenv("XDG_CONFIG_HOME", str(where / "config"))
        spec = yaml.safe_load(QUICKSTART.read_text())
        spec["evaluation"] = {"final": False}  # test_final_evaluation
        spec.update(name="broken", rounds=1, failure={"retries": 0})
        spec["training"].update(steps=2, batch_size=4)
        for site in spec["sites"]:
            site["ranks"] = 1
            site["data"]["synthetic_sequences"] = 64
        folder = write_shards(home / "sites" / "beta" / "prepared" / "beta", 4096)
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "flags": "flags.bin"}))
        spec["sites"][1]["data"] = {"path": "prepared/beta"}
        job = where / "job.yaml"
        job.write_text(yaml.safe_dump(spec, sort_keys=False))
        done = runner.invoke(app, ["submit", str(job), "--wait", "--json"])
        assert done.exit_code == 1, done.output
        status = json.loads(done.stdout)
        assert status["state"] == "failed"
    yield home, status


@pytest.fixture
def in_failed_run(failed_run: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch) -> dict:
    """The failed run's status, XFFL_HOME pointing at its data directory."""
    monkeypatch.setenv("XFFL_HOME", str(failed_run[0]))
    return failed_run[1]


def _beta_reason(status: dict) -> str:
    (rnd,) = status["rounds"]
    (beta,) = [s for s in rnd["sites"] if s["site"] == "beta"]
    assert beta["state"] == "failed" and "meta.json promises 4096 flags" in beta["reason"]
    return str(beta["reason"])


def test_logs_of_a_failed_run_start_with_its_cause_and_hide_tracebacks(in_failed_run: dict
                                                                       ) -> None:
    status = in_failed_run
    layout = RunLayout(Path(status["run_dir"]))
    raw = layout.streamflow_log.read_text() + layout.supervisor_log.read_text()
    assert raw.count("Traceback (most recent call last):") >= 2  # what the user was shown
    result = runner.invoke(app, ["logs", status["run_id"]])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == ["== cause ==", f"run {status['run_id']} failed: {status['message']}",
                         f"round 1, site beta: failed: {_beta_reason(status)}"]
    assert "Traceback" not in result.stdout and '  File "' not in result.stdout
    assert "(traceback hidden: --debug shows it)" in result.stdout
    # --debug, anywhere: every line of the logs' tails, the tracebacks with them
    debug = runner.invoke(app, ["logs", status["run_id"], "--debug", "-n", "100000"])
    assert debug.exit_code == 0 and debug.stdout.splitlines()[:3] == lines[:3]
    assert debug.stdout.count("Traceback (most recent call last):") == \
        raw.count("Traceback (most recent call last):")


def test_logs_json_and_one_site(in_failed_run: dict) -> None:
    status = in_failed_run
    data = check("logs", json.loads(runner.invoke(app, ["logs", "last", "--json"]).stdout))
    assert data["cause"][1] == f"round 1, site beta: failed: {_beta_reason(status)}"
    assert not any("Traceback" in line for line in data["streamflow_log"] + data["runner_log"])
    beta = check("logs", json.loads(runner.invoke(app, ["logs", "--site", "beta",
                                                        "--json"]).stdout))
    alpha = check("logs", json.loads(runner.invoke(app, ["logs", "--site", "alpha",
                                                         "--json"]).stdout))
    assert beta["cause"] == data["cause"] and alpha["cause"] == data["cause"][:1]


def test_logs_follow_exits_1_after_a_failed_run_0_after_a_completed_one(
        in_failed_run: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As `xffl watch`: a script's `xffl logs -f RUN && next-step` must not go on."""
    status = in_failed_run
    followed = runner.invoke(app, ["logs", status["run_id"], "-f"])
    assert followed.exit_code == 1, followed.output
    assert f"round 1, site beta: failed: {_beta_reason(status)}" in followed.stdout
    site = runner.invoke(app, ["logs", status["run_id"], "-f", "--site", "beta"])
    assert site.exit_code == 1, site.output
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
