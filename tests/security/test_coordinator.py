"""The coordinator's own hygiene: processes it signals, runs it calls alive, what cron runs.

Each test attacks one defence: an unrelated process behind a recorded pid, a cancel racing a
cron tick, a run whose supervisor died without a word, values that would inject crontab
lines, a registry on a network filesystem, a job folder shadowing an installed profile.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.security.processes import lock_holder
from xffl.cli.app import app
from xffl.core.errors import InvalidInput
from xffl.jobs import cancel as cancel_mod
from xffl.jobs import schedule
from xffl.jobs.registry.round_lock import holder, round_lock
from xffl.jobs.registry.store import Registry
from xffl.jobs.status import orphan_message, settle
from xffl.workflows import supervisor

runner = CliRunner()


def _run(tmp_path: Path, state: str = "running") -> tuple[Registry, str, Path]:
    """A registered run of the quickstart (no supervisor), in ``state``."""
    job = tmp_path / "job.yaml"
    job.write_text(QUICKSTART.read_text())
    submitted = runner.invoke(app, ["submit", str(job), "--no-start", "--json"])
    assert submitted.exit_code == 0, submitted.output
    data = json.loads(submitted.stdout)
    registry = Registry()
    registry.set_state(data["run_id"], state, "set by the test")
    return registry, data["run_id"], Path(data["run_dir"])


@contextmanager
def _bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process in a session of its own (what a reused pid may now be)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_cancel_spares_the_process_behind_a_stale_pid(tmp_path: Path) -> None:
    registry, run_id, _ = _run(tmp_path)
    with _bystander() as bystander:
        # the registry names the bystander as the run's supervisor (a pid since reused)
        registry.set_state(run_id, "running", "stale", runner_pid=bystander.pid)
        result = runner.invoke(app, ["cancel", run_id])
        assert result.exit_code == 0, result.output
        time.sleep(0.2)
        assert bystander.poll() is None, "cancel killed an unrelated process"
    assert registry.get_run(run_id).state == "cancelled"


def test_cancel_stops_the_process_holding_the_round_lock(tmp_path: Path) -> None:
    registry, run_id, run_dir = _run(tmp_path)
    with _bystander() as bystander:
        registry.set_state(run_id, "running", "stale", runner_pid=bystander.pid)
        executing = lock_holder(run_dir)
        result = runner.invoke(app, ["cancel", run_id])
        assert result.exit_code == 0, result.output
        executing.wait(timeout=10)
        assert holder(run_dir) is None and bystander.poll() is None


def test_a_run_that_no_process_runs_is_not_shown_running(tmp_path: Path) -> None:
    registry, run_id, run_dir = _run(tmp_path)
    executing = lock_holder(run_dir)
    try:
        shown = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
        assert shown["state"] == "running" and shown["runner_alive"]
    finally:
        executing.send_signal(signal.SIGKILL)  # dies without a word, as on a full disk
        executing.wait(timeout=10)
    shown = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
    assert shown["state"] == "failed" and shown["message"] == orphan_message(run_id)
    listed = json.loads(runner.invoke(app, ["runs", "--json"]).stdout)
    assert [r["state"] for r in listed if r["run_id"] == run_id] == ["failed"]
    # cron runs (waiting) and submitted runs have no supervisor and are left as they are
    registry.set_state(run_id, "waiting", "between ticks")
    assert settle(registry, registry.get_run(run_id)).state == "waiting"


def test_a_failure_the_registry_cannot_record_still_ends_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    registry, run_id, run_dir = _run(tmp_path, state="submitted")

    def disk_full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    def crash(*args: object, **kwargs: object) -> int:
        monkeypatch.setattr(Registry, "set_state", disk_full)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(supervisor, "_execute_locked", crash)
    assert supervisor.execute(run_id, registry) == 1  # no exception escapes
    assert "could not record the failure in the registry" in capsys.readouterr().out
    # the registry still says running (as the supervisor had set it); the lock is free
    monkeypatch.undo()
    registry.set_state(run_id, "running", "supervisor started")
    monkeypatch.setattr(Registry, "set_state", disk_full)
    shown = settle(registry, registry.get_run(run_id))  # the disk is still full
    assert shown.state == "failed" and shown.message == orphan_message(run_id)
    monkeypatch.undo()
    assert settle(registry, registry.get_run(run_id)).state == "failed"
    assert registry.get_run(run_id).state == "failed"  # recorded once it could be
    assert holder(run_dir) is None


def test_a_cron_tick_after_cancel_does_not_revive_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`xffl round` reads the run as waiting; a cancel lands before it takes the lock."""
    registry, run_id, run_dir = _run(tmp_path, state="waiting")
    real_lock = supervisor.round_lock

    @contextmanager
    def cancelled_first(path: Path) -> Iterator[None]:
        assert runner.invoke(app, ["cancel", run_id]).exit_code == 0
        with real_lock(path):
            yield

    monkeypatch.setattr(supervisor, "round_lock", cancelled_first)
    result = runner.invoke(app, ["round", run_id, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "cancelled"
    assert not (run_dir / "rounds" / "0").exists()  # nothing was started
    assert registry.get_run(run_id).rounds_done == 0


def test_a_cron_tick_while_cancel_runs_finds_the_run_cancelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick lands between the runner's stop and cancel's last record: it starts nothing
    (HEAD recorded the cancel last, with no lock held: the tick started a round)."""
    registry, run_id, _ = _run(tmp_path, state="waiting")
    rounds: list[str] = []
    monkeypatch.setattr(supervisor, "_run", lambda *args: rounds.append("started") or 0)
    ticks: list[int] = []
    real_stop = cancel_mod.stop_runner

    def stop_then_tick(run: Any, *args: Any) -> bool:
        stopped = real_stop(run, *args)
        ticks.append(supervisor.execute(run_id, registry, once=True))
        return stopped

    monkeypatch.setattr(cancel_mod, "stop_runner", stop_then_tick)
    assert runner.invoke(app, ["cancel", run_id]).exit_code == 0
    assert ticks == [0] and rounds == []
    assert registry.get_run(run_id).state == "cancelled"


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("dangling", [False, True])
def test_init_writes_no_file_through_a_symlinked_job_yaml(
        tmp_path: Path, force: bool, dangling: bool) -> None:
    """A shared folder's job.yaml is a link to the user's file (or to where one would be
    made): xffl init refuses it, even with --force, and the target is untouched."""
    folder = tmp_path / "shared"
    folder.mkdir()
    target = tmp_path / "bashrc"
    if not dangling:
        target.write_text("the user's own file\n")
    (folder / "job.yaml").symlink_to(target)
    result = runner.invoke(app, ["init", str(folder), *(["--force"] if force else [])])
    assert result.exit_code == 2, result.output
    assert "symbolic link" in result.stderr
    assert (folder / "job.yaml").is_symlink()
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text() == "the user's own file\n"


@pytest.mark.parametrize(("variable", "value"), [
    ("XFFL_HOME", "{home}\n* * * * * touch {home}-pwned"),
    ("HOME", "/root\n* * * * * id"),
    ("SSH_AUTH_SOCK", "/tmp/agent%sock"),
])
def test_values_that_would_inject_crontab_lines_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    _registry, run_id, _ = _run(tmp_path, state="waiting")
    monkeypatch.setattr(schedule, "_crontab", lambda: pytest.fail("the crontab was opened"))
    if variable == "XFFL_HOME":  # the same registry, reached through a path with a newline
        home = tmp_path / "xffl-home"
        evil = Path(value.format(home=tmp_path / "h"))
        evil.mkdir(parents=True)
        (evil / "registry.db").symlink_to(home / "registry.db")
        value = str(evil)
    monkeypatch.setenv(variable, value)
    result = runner.invoke(app, ["schedule", run_id, "--cron", "*/5 * * * *"])
    assert result.exit_code == 2, result.output
    assert "cannot stand in a crontab line" in result.stderr
    with pytest.raises(InvalidInput, match="crontab"):
        schedule.crontab_safe("x", "a\rb")


@pytest.mark.slow
@pytest.mark.serial
def test_cancel_removes_the_runs_crontab_entry(tmp_path: Path) -> None:
    registry, run_id, _ = _run(tmp_path, state="waiting")
    assert runner.invoke(app, ["schedule", run_id, "--cron", "0 3 * * *"]).exit_code == 0
    try:
        assert schedule.current(run_id) is not None
        result = runner.invoke(app, ["cancel", run_id])
        assert result.exit_code == 0, result.output
        assert schedule.current(run_id) is None
        assert "cron entry removed" in registry.get_run(run_id).message
    finally:
        schedule.remove(run_id)


def test_the_registry_keeps_no_write_ahead_log_on_a_network_filesystem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Registry(tmp_path / "local" / "registry.db").journal_mode == "WAL"
    mountinfo = tmp_path / "mountinfo"
    shared = tmp_path / "home on nfs"
    escaped = str(shared).replace(" ", "\\040")
    mountinfo.write_text(Path("/proc/self/mountinfo").read_text() +
                         f"900 1 0:99 / {escaped} rw,relatime - nfs4 srv:/home rw,vers=4.2\n")
    monkeypatch.setattr("xffl.core.fstype.MOUNTINFO", mountinfo)
    registry = Registry(shared / "xffl" / "registry.db")
    assert registry.journal_mode == "DELETE"
    registry.create_run("r-1", "r", tmp_path / "job.yaml", tmp_path / "run", 1, ["a"])
    with sqlite3.connect(registry.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert not Path(f"{registry.path}-wal").exists()


def test_a_job_folder_cannot_shadow_an_installed_profile(tmp_path: Path) -> None:
    folder = tmp_path / "from-a-collaborator"
    (folder / "site_profiles").mkdir(parents=True)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    # `local` is bundled: this one would run the sites with another Python
    (folder / "site_profiles" / "local.yaml").write_text(yaml.safe_dump(
        {"name": "local", "python": "/tmp/not-the-python-you-think"}))
    result = runner.invoke(app, ["validate", str(folder / "job.yaml")])
    assert result.exit_code == 2, result.output
    assert "cannot replace an installed profile" in result.stderr
    assert "local.yaml" in result.stderr
    # the same profile under its own name is fine
    (folder / "site_profiles" / "local.yaml").rename(folder / "site_profiles" / "mine.yaml")
    (folder / "site_profiles" / "mine.yaml").write_text(yaml.safe_dump({"name": "mine"}))
    for site in spec["sites"]:
        site["profile"] = "mine"
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["validate", str(folder / "job.yaml")])
    assert result.exit_code == 0, result.output


def test_the_lock_holder_is_named_by_the_kernel_not_by_a_stale_file(tmp_path: Path) -> None:
    (tmp_path / "round.lock").write_text(f"{os.getpid()} {os.uname().nodename}\n")
    assert holder(tmp_path) is None  # a pid left in the file by a dead holder means nothing
    with round_lock(tmp_path):
        assert holder(tmp_path) == os.getpid()
    proc = lock_holder(tmp_path)
    try:
        assert holder(tmp_path) == proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)
