"""Status and cancel of a run at two SLURM facilities (the real test stack); `xffl logs` of a
completed SLURM run is tested on the run of tests/workflows/test_slurm_sites.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.stack.profiles import write_profile
from xffl.cli import cancel, status, submit
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import parse_squeue

app = typer.Typer()
app.command()(submit.submit)
app.command()(status.status)
app.command()(cancel.cancel)
runner = CliRunner()


def _job(tmp_path: Path, stack, name: str, setup: list[str]) -> Path:  # type: ignore[no-untyped-def]
    profiles = tmp_path / "site_profiles"
    profiles.mkdir(exist_ok=True)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name=name, rounds=1)
    spec["training"]["steps"] = 4
    for site in spec["sites"]:
        site["ranks"] = 1  # cancelling is under test, not DDP
        site["profile"] = write_profile(profiles, stack.clusters[site["name"]], stack, setup)
        site["data"]["path"] = str(tmp_path / "data" / site["name"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def _squeue(stack, cluster: str, name: str) -> list[str]:  # type: ignore[no-untyped-def]
    out = stack.ssh(cluster, f"squeue -h -n {name} -o '%i|%T'", timeout=20)
    assert out.returncode == 0, out.stderr
    return [ln for ln in out.stdout.splitlines() if ln.strip()]


def test_parse_squeue() -> None:
    text = ("2026-11-22T07:00:10\n"
            "12|xffl-r1-alpha-r3|RUNNING|2026-11-22T07:00:00|2026-11-22T07:00:02|0:08|n[1-2]\n"
            "13|xffl-r1-alpha|PENDING|2026-11-22T07:00:05|N/A|0:00|\n"
            "14|xffl-r1-alpha-2|PENDING|2026-11-22T07:00:05|N/A|0:00|\n"  # site alpha-2
            "15|xffl-r1-alphabet-r1|PENDING|2026-11-22T07:00:05|N/A|0:00|\n"
            "16|other|RUNNING|2026-11-22T07:00:05|2026-11-22T07:00:05|0:05|n3\n")
    running, pending = parse_squeue("r1", "alpha", text, rnd=4)
    assert (running.job_id, running.round, running.name, running.nodes, running.state,
            running.queue_wait_s, running.run_s) == \
        ("12", 3, "xffl-r1-alpha-r3", "n[1-2]", "RUNNING", 2.0, 8.0)
    # a job not renamed yet belongs to the round the caller says is in flight
    assert (pending.job_id, pending.round, pending.state, pending.queue_wait_s) == \
        ("13", 4, "PENDING", 5.0)


@pytest.mark.slow
def test_status_then_cancel_running_slurm_run(tmp_path: Path, slurm_stack,  # type: ignore[no-untyped-def]
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    job = _job(tmp_path, slurm_stack, "cancelme", ["sleep 300"])
    result = runner.invoke(app, ["submit", str(job), "--json"])
    assert result.exit_code == 0, result.output
    run_id = json.loads(result.stdout)["run_id"]
    names = {c: f"xffl-{run_id}-{c}-r1" for c in ("alpha", "beta")}
    try:
        _cancel_scenario(slurm_stack, run_id, names)
    finally:  # never leave a 300 s job holding the test clusters' CPUs
        for c, n in names.items():
            slurm_stack.ssh(c, f"scancel -n {n}; scancel -n {n[:-3]}", timeout=20)
        record = Registry().get_run(run_id)
        if record.runner_pid and not record.finished:
            pid = record.runner_pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _cancel_scenario(slurm_stack, run_id: str, names: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 40
    while not all(any(ln.endswith("|RUNNING") for ln in _squeue(slurm_stack, c, n))
                  for c, n in names.items()):
        assert time.monotonic() < deadline, "the jobs did not start RUNNING in 40 s"
        time.sleep(0.5)

    result = runner.invoke(app, ["status", run_id, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["state"] == "running"
    by_site = {j["site"]: j for j in data["slurm"]}
    assert set(by_site) == {"alpha", "beta"}
    for c, j in by_site.items():
        assert j["state"] == "RUNNING" and j["round"] == 1 and j["reachable"]
        assert _squeue(slurm_stack, c, names[c])[0].split("|")[0] == j["job_id"]
    pid = data["runner_pid"]
    assert pid

    started = time.monotonic()
    result = runner.invoke(app, ["cancel", run_id])
    assert result.exit_code == 0, result.output
    for c, n in names.items():
        while _squeue(slurm_stack, c, n):
            assert time.monotonic() - started < 10, f"{n} still in squeue"
            time.sleep(0.3)
    with pytest.raises(ChildProcessError):  # reaped by cancel (the runner is our child here)
        os.waitpid(pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    data = json.loads(runner.invoke(app, ["status", run_id, "--json"]).stdout)
    assert data["state"] == "cancelled"
    assert {s["state"] for r in data["rounds"] for s in r["sites"]} == {"cancelled"}
    # cancelling again: nothing to do, exit 0
    again = runner.invoke(app, ["cancel", run_id])
    assert again.exit_code == 0 and "already cancelled" in again.stdout
