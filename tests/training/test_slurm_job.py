"""The launcher's SLURM job record and rename, against a stand-in scontrol (the stack test uses
the real one)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from xffl.training import slurm_job

SHOW = ("JobId=77 JobName={name} UserId=me(1) JobState=RUNNING SubmitTime=2026-11-22T07:00:00 "
        "StartTime=2026-11-22T07:00:03 Partition=debug NodeList=n[1-2] BatchHost=n1\n")


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, update_rc: int = 0) -> Path:
    """An scontrol that logs its arguments, keeps the job's name in a file, shows the job."""
    calls = tmp_path / "calls.txt"
    name = tmp_path / "name.txt"
    name.write_text("xffl-run-alpha")
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$1" = update ]; then\n'
        f'  [ {update_rc} = 0 ] && echo "${{3#JobName=}}" > {name}; exit {update_rc}\n'
        "fi\n"
        f"printf '{SHOW.replace('{name}', '%s')}' \"$(cat {name})\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_outside_slurm_nothing_happens(tmp_path: Path) -> None:
    assert slurm_job.start("xffl-run-alpha-r1", {}) is None
    assert slurm_job.finish(None, tmp_path / "update", 0) is None
    assert not any(tmp_path.iterdir())


def test_renamed_and_recorded_beside_the_checkpoint(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "xffl-run-alpha", "SLURM_CLUSTER_NAME": "c"}
    record = slurm_job.start("xffl-run-alpha-r3", env)
    assert calls.read_text().splitlines() == ["update JobId=77 JobName=xffl-run-alpha-r3",
                                              "show -o job 77"]
    assert record is not None
    assert (record["job_name"], record["renamed_from"], record["node_list"],
            record["queue_wait_s"]) == ("xffl-run-alpha-r3", "xffl-run-alpha", "n[1-2]", 3.0)
    update = tmp_path / "update"
    update.mkdir()
    written = slurm_job.finish(record, update, 0)
    assert written == update / slurm_job.RECORD_FILE
    data = slurm_job.read_record(update)
    assert data is not None
    assert (data["job_id"], data["job_name"], data["exit_code"], data["cluster"]) == (
        "77", "xffl-run-alpha-r3", 0, "c")


def test_named_job_is_not_renamed_and_failure_lands_beside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_scontrol(tmp_path, monkeypatch)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "xffl-run-alpha"}
    record = slurm_job.start("xffl-run-alpha", env)
    assert calls.read_text().splitlines() == ["show -o job 77"]
    written = slurm_job.finish(record, tmp_path / "update", 1)  # no checkpoint was written
    assert written == tmp_path / "update.slurm_job.json"
    assert json.loads(written.read_text())["exit_code"] == 1


def test_a_failed_rename_is_recorded_not_raised(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_scontrol(tmp_path, monkeypatch, update_rc=1)
    record = slurm_job.start("xffl-run-alpha-r1", {"SLURM_JOB_ID": "77",
                                                   "SLURM_JOB_NAME": "xffl-run-alpha"})
    assert record is not None
    assert record["job_name"] == "xffl-run-alpha" and "rename_error" in record
