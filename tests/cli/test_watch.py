"""`xffl watch`: re-attach to a run; its exit codes (0, 1, 4, 130) through the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.security.processes import lock_holder
from xffl.cli.app import app
from xffl.jobs.registry.store import Registry

runner = CliRunner()
XFFL = str(Path(sys.executable).parent / "xffl")


def _waiting_run() -> str:
    """A registered run left to cron (`--no-start`): nothing runs, it waits for a tick."""
    result = runner.invoke(app, ["submit", str(QUICKSTART), "--no-start", "--json"])
    assert result.exit_code == 0, result.output
    run_id: str = json.loads(result.stdout)["run_id"]
    return run_id


def _runner(run_id: str) -> subprocess.Popen[bytes]:
    """A live process holding the run's round lock, as its runner (a supervisor, a cron
    tick's `xffl round`) does: something moves the run, so watch follows it."""
    return lock_holder(Path(Registry().get_run(run_id).run_dir))


def test_watch_of_a_run_nothing_moves_says_so(xffl_home: Path) -> None:
    """A `--no-start` run that no cron entry ticks would wait a day for nothing: exit 2 at
    once, naming what would move it (issue 31 item 12)."""
    run_id = _waiting_run()
    for argv in (["watch"], ["watch", run_id, "--json"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, result.output
        assert "nothing runs it (no runner, no cron entry)" in result.stderr
        assert f"`xffl round {run_id}`" in result.stderr
    assert json.loads(result.stdout)["error"]["kind"] == "invalid_input"


def test_watch_gives_up_after_its_timeout_and_the_run_goes_on(xffl_home: Path) -> None:
    run_id = _waiting_run()
    holder = _runner(run_id)
    try:
        result = runner.invoke(app, ["watch", "last", "--timeout", "0.3"])
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 4, result.output
    # not a terminal: plain lines, one per change of state or rounds
    assert result.stdout.splitlines() == [
        f"following run {run_id} (Ctrl-C stops following, not the run)",
        f"{run_id} waiting 0/3 rounds"]
    assert f"run {run_id} still waiting after 0 s" in result.stderr
    assert Registry().get_run(run_id).state == "waiting"


def test_watch_a_run_that_ended(xffl_home: Path) -> None:
    run_id = _waiting_run()
    assert runner.invoke(app, ["cancel", run_id]).exit_code == 0
    result = runner.invoke(app, ["watch", run_id[:12]])
    assert result.exit_code == 1, result.output
    assert f"run {run_id} cancelled" in result.stdout
    as_json = runner.invoke(app, ["watch", run_id, "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["state"] == "cancelled"


def test_submit_refuses_wait_without_start(xffl_home: Path) -> None:
    result = runner.invoke(app, ["submit", str(QUICKSTART), "--no-start", "--wait"])
    assert result.exit_code == 2 and "xffl watch RUN" in result.stderr
    assert Registry().list_runs() == []  # nothing registered


def test_ctrl_c_stops_following_not_the_run(xffl_home: Path) -> None:
    run_id = _waiting_run()
    holder = _runner(run_id)
    # as from an interactive shell: SIGINT at its default (a pytest-xdist worker ignores it,
    # and a child inherits that; Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen([XFFL, "watch", run_id], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        lines = []
        while not any(line.startswith(run_id) for line in lines):  # it is following
            assert time.monotonic() < deadline, lines
            lines.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        holder.kill()
        holder.wait()
    # issue 44 (Low): it says the run goes on, and how to follow or cancel it
    assert proc.returncode == 130 and err == (
        f"interrupted: run {run_id} goes on; follow it with `xffl watch {run_id}`, cancel it "
        f"with `xffl cancel {run_id}`.\n")
    assert Registry().get_run(run_id).state == "waiting"


def test_ctrl_c_during_submit_wait_says_the_run_goes_on(xffl_home: Path) -> None:
    """`xffl submit --wait` interrupted while it follows: exit 130, the run (its supervisor
    in a session of its own) goes on, and the words say how to follow or cancel it."""
    proc = subprocess.Popen([XFFL, "submit", str(QUICKSTART), "--wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("submitted run ") and "following it" in first, first
        run_id = first.split()[2].rstrip(";")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert err.endswith(f"interrupted: run {run_id} goes on; follow it with `xffl watch "
                            f"{run_id}`, cancel it with `xffl cancel {run_id}`.\n"), err
        assert not Registry().get_run(run_id).finished  # it goes on
    finally:
        proc.kill()
        for run in Registry().list_runs():
            runner.invoke(app, ["cancel", run.id])


def _one_round_done(run_id: str) -> None:
    """Round 1 of the run completed with a training and a validation loss; round 2 going."""
    from xffl.jobs.registry.records import RoundRecord

    registry = Registry()
    registry.start_round(run_id, 1, ["alpha", "beta"])
    registry.finish_round(run_id, RoundRecord(round=1, state="completed", started=time.time(),
                                              ended=time.time(), loss=3.354575, val_loss=5.1234))
    registry.start_round(run_id, 2, ["alpha", "beta"])
    registry.set_state(run_id, "running", "supervisor started")


def test_watch_shows_the_latest_rounds_loss_while_it_runs(xffl_home: Path) -> None:
    """Issue 44 (Low): round counts and the latest round's training and validation loss,
    in a pipe (one line per change) and on a terminal (the progress bar's words)."""
    run_id = _waiting_run()
    holder = _runner(run_id)
    try:
        before = runner.invoke(app, ["watch", run_id, "--timeout", "0.3"])
        _one_round_done(run_id)
        piped = runner.invoke(app, ["watch", run_id, "--timeout", "0.3"])
        env = {**os.environ, "COLUMNS": "160", "FORCE_COLOR": "1", "TERM": "xterm"}
        on_terminal = subprocess.run([XFFL, "watch", run_id, "--timeout", "1"],
                                     capture_output=True, text=True, env=env, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert before.stdout.splitlines()[1] == f"{run_id} waiting 0/3 rounds"  # no loss yet
    assert piped.exit_code == 4, piped.output
    assert piped.stdout.splitlines()[1] == \
        f"{run_id} running 1/3 rounds; round 1 loss 3.3546 val loss 5.1234"
    assert on_terminal.returncode == 4, on_terminal.stderr
    assert "running: round 2; round 1 loss 3.3546 val loss 5.1234" in on_terminal.stdout
