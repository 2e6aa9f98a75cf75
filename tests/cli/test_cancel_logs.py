"""`xffl status/cancel/logs` without a cluster: unreachable sites, finished runs, local logs."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import typer
from typer.testing import CliRunner

from tests.security.processes import lock_holder
from xffl.cli import cancel, logs, status
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.round_lock import holder
from xffl.jobs.registry.store import Registry

app = typer.Typer()
app.command()(status.status)
app.command()(cancel.cancel)
app.command()(logs.logs)
runner = CliRunner()

def _execution(site: str, job: str, rnd: int, directory: str) -> str:
    """An EXECUTING entry of a train step as StreamFlow logs it: the command follows."""
    return (f"2026-11-22 06:23:58,227 INFO     EXECUTING step /rounds/train_{site} (job {job}) "
            f"locally into directory {directory}:\n/usr/bin/python -m xffl.training.launch \\\n"
            f"\t--ranks \\\n\t2 \\\n\t-- \\\n\t--round \\\n\t{rnd} \\\n\t--out \\\n\tupdate\n")


SF_LOG = (_execution("alpha", "/rounds/train_alpha/0.0", 1, "/tmp/x/d56b")
          + _execution("beta", "/rounds/train_beta/0.0", 1, "/tmp/x/92d7")
          + '2026-11-22 06:24:13,078 INFO     {"site": "beta", "round": 1, "num_samples": 512}\n'
          + '2026-11-22 06:24:13,154 INFO     {"site": "alpha", "round": 1, "num_samples": 768}\n'
          + _execution("beta", "/rounds/train_beta/0.1", 2, "/tmp/x/a0a0")
          + '2026-11-22 06:24:30,000 INFO     {"site": "beta", "round": 2, "num_samples": 512}\n'
          + "2026-11-22 06:24:31,000 INFO     COMPLETED Job /rounds/train_beta/0.1\n")
# `xffl round` (one round per cron tick) appends one workflow per tick: each names the first
# round's job .../0.0, so the job name alone does not tell round 3 from round 1
TICK = (_execution("beta", "/rounds/train_beta/0.0", 3, "/tmp/x/c3c3")
        + "2026-11-22 07:00:09,000 INFO     COPYING from /tmp/x/c3c3/update to /run/rounds/3\n"
        + '2026-11-22 07:00:10,000 INFO     {"site": "beta", "round": 3, "num_samples": 512}\n'
        + "2026-11-22 07:00:11,000 INFO     COMPLETED Job /rounds/train_beta/0.0\n")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, slurm_alpha: bool) -> tuple[Registry, str]:
    registry = Registry()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    profiles = {"alpha": {"name": "a"}, "beta": {"name": "b"}}
    if slurm_alpha:
        profiles["alpha"] = {
            "name": "a", "slurm": {"partition": "debug"},
            "connector": {"type": "ssh", "host": "127.0.0.1", "port": _closed_port(),
                          "known_hosts": str(tmp_path / "none")}}
    (run_dir / "profiles.json").write_text(json.dumps(profiles))
    (run_dir / "streamflow.log").write_text(SF_LOG)
    (run_dir / "supervisor.log").write_text("supervisor says hello\n")
    registry.create_run("r1", "r", tmp_path / "job.yaml", run_dir, 2, ["alpha", "beta"])
    registry.set_state("r1", "running", "runner started")
    registry.start_round("r1", 1, ["alpha", "beta"])
    return registry, "r1"


def test_status_and_cancel_with_unreachable_site(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path, slurm_alpha=True)
    supervisor = lock_holder(tmp_path / "run")  # a live process runs the run
    result = runner.invoke(app, ["status", run_id, "--json"])
    assert result.exit_code == 0, result.output
    (job,) = json.loads(result.stdout)["slurm"]
    assert job["site"] == "alpha" and job["reachable"] is False and job["round"] == 1
    text = runner.invoke(app, ["status", run_id])
    assert text.exit_code == 0 and "unreachable" in text.stdout

    result = runner.invoke(app, ["cancel", run_id])
    assert result.exit_code == 3, result.output
    supervisor.wait(timeout=10)  # cancel stopped it (and reaped it: it is our child)
    assert holder(tmp_path / "run") is None
    run = registry.get_run(run_id)
    assert run.state == "cancelled" and "xffl-r1-alpha" in run.message
    (rnd,) = registry.rounds(run_id)
    assert rnd.state == "cancelled" and {s.state for s in rnd.sites} == {"cancelled"}


def test_cancel_finished_run_is_a_no_op(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path, slurm_alpha=False)
    registry.finish_round(run_id, RoundRecord(round=1, state="completed",
                                              sites=[SiteRound("alpha", "completed")]))
    registry.set_state(run_id, "completed", "done")
    result = runner.invoke(app, ["cancel", run_id])
    assert result.exit_code == 0 and "already completed" in result.stdout
    assert registry.get_run(run_id).state == "completed"


def test_logs_of_local_sites(tmp_path: Path) -> None:
    _, run_id = _run(tmp_path, slurm_alpha=False)
    result = runner.invoke(app, ["logs", run_id])
    assert result.exit_code == 0 and "supervisor says hello" in result.stdout
    result = runner.invoke(app, ["logs", run_id, "--site", "beta", "--round", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["source"] == "streamflow.log" and data["round"] == 1
    assert data["directory"] == "/tmp/x/92d7"
    text = "\n".join(data["lines"])
    assert '"site": "beta"' in text and "train_beta/0.0" in text and "train_alpha" not in text
    assert "train_beta/0.1" not in text and '"round": 2' not in text  # round 1's lines only
    latest = json.loads(runner.invoke(app, ["logs", run_id, "--site", "beta", "--json"]).stdout)
    assert latest["round"] == 2 and latest["directory"] == "/tmp/x/a0a0"
    assert runner.invoke(app, ["logs", run_id, "--site", "gamma"]).exit_code == 2
    assert runner.invoke(app, ["logs", run_id, "--site", "beta", "--round", "3"]).exit_code == 2
    alone = runner.invoke(app, ["logs", run_id, "--round", "1"])  # --round of no site
    assert alone.exit_code == 2 and "add --site" in alone.stderr


def test_logs_of_a_round_run_by_a_later_tick(tmp_path: Path) -> None:
    registry, run_id = _run(tmp_path, slurm_alpha=False)
    run_dir = Path(registry.get_run(run_id).run_dir)
    with open(run_dir / "streamflow.log", "a") as log:
        log.write(TICK)
    one = json.loads(runner.invoke(app, ["logs", run_id, "--site", "beta", "--round", "1",
                                         "--json"]).stdout)
    assert one["directory"] == "/tmp/x/92d7"
    text = "\n".join(one["lines"])
    assert "c3c3" not in text and "07:00" not in text and '"round": 3' not in text
    three = json.loads(runner.invoke(app, ["logs", run_id, "--site", "beta", "--round", "3",
                                           "--json"]).stdout)
    assert three["round"] == 3 and three["directory"] == "/tmp/x/c3c3"
    # its EXECUTING entry, the trainer's report and its completion (COPYING names no job)
    assert [line[:19] for line in three["lines"] if line[:4] == "2026"] == [
        "2026-11-22 06:23:58", "2026-11-22 07:00:10", "2026-11-22 07:00:11"]
    assert "92d7" not in "\n".join(three["lines"])
