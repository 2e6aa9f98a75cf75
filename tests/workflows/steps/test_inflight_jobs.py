"""The record of a site's SLURM job in flight: owner-only, atomic, read back only when it is
the asked site's and round's and names a plain job id and folder; each case a registry event."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from xffl.core.layout import Registration, RunLayout
from xffl.jobs.registry.store import Registry
from xffl.workflows.steps.inflight_jobs import (
    EVENT,
    InflightJob,
    adopted_message,
    clear_inflight,
    note,
    read_inflight,
    record_submitted,
)


def _job(**kw: object) -> InflightJob:
    return InflightJob(**{"site": "beta", "round": 2, "job_id": "4242",  # type: ignore[arg-type]
                          "workdir": "/scratch/xffl/beta/job-1", **kw})


def test_a_record_is_owner_only_and_read_back_until_cleared(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    job = _job()
    path = record_submitted(layout, job)
    assert path == tmp_path / "rounds" / "2" / "inflight" / "beta.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["beta.json"]  # no temporary left
    assert read_inflight(layout, 2, "beta") == job
    assert read_inflight(layout, 1, "beta") is None and read_inflight(layout, 2, "alpha") is None
    clear_inflight(layout, 2, "beta")
    assert read_inflight(layout, 2, "beta") is None
    clear_inflight(layout, 2, "beta")  # twice: nothing to clear


@pytest.mark.parametrize("bad", [{"job_id": "4242;cluster"}, {"job_id": "$(reboot)"},
                                 {"workdir": "/scratch/$(reboot)"}])
def test_what_sbatch_answered_must_be_a_plain_id_and_the_folder_plain_text(
        tmp_path: Path, bad: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"not a SLURM job id|not plain path text"):
        record_submitted(RunLayout(tmp_path), _job(**bad))


@pytest.mark.parametrize("edit", [
    {"job_id": "12 && scancel -u $USER"}, {"workdir": "/x/`id`"}, {"site": "alpha"},
    {"round": 3}, {"job_id": None}])
def test_a_record_that_is_not_the_sites_or_not_plain_is_ignored_and_said(
        tmp_path: Path, edit: dict[str, object]) -> None:
    """A record edited by hand (or another site's, another round's) is not acted on: the step
    submits a new job, and the registry says why."""
    layout = RunLayout(tmp_path)
    registry = Registry(tmp_path / "registry.db")
    Registration(run_id="r1", registry=registry.path).write(layout)
    path = record_submitted(layout, _job())
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    assert read_inflight(layout, 2, "beta") is None
    (event,) = [m for _, kind, m in registry.events("r1") if kind == EVENT]
    assert "round 2: beta: the record beta.json of its job in flight" in event
    assert "a new job is submitted" in event


def test_a_note_is_a_registry_event_in_a_registered_run_only(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    note(layout, "nothing registered: no registry written")
    assert not (tmp_path / "registry.db").exists()
    registry = Registry(tmp_path / "registry.db")
    Registration(run_id="r1", registry=registry.path).write(layout)
    note(layout, adopted_message(_job(supervisor=77)))
    (event,) = [m for _, kind, m in registry.events("r1") if kind == EVENT]
    assert event == ("round 2: beta: SLURM job 4242 (submitted by supervisor pid 77) "
                             "is still queued or running: adopted, no second job submitted")
