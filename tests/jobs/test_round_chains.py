"""A chained round's jobs (training.checkpoint.chain) from the update's slurm_job.json to the
registry and `xffl status`: each job with its steps, a round in flight with steps done and an
ETA; a facility's list is validated (ids and bounded numbers only) or left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from xffl.core.layout import RunLayout
from xffl.jobs.chains import round_chains
from xffl.jobs.registry.attempts import SiteAttempts, write_attempts
from xffl.jobs.registry.store import Registry
from xffl.jobs.slurm_view import CONTINUED, record_delivered, recorded_view
from xffl.training.chain_files import CONTINUE_LINE
from xffl.training.slurm_job import MAX_ROUND_JOBS, ROUND_JOBS, read_record
from xffl.workflows.steps.attempts import continues


def chain_jobs() -> list[dict[str, Any]]:
    """Three jobs of a 60-step round, as the site's launcher lists them."""
    return [{"job_id": str(100 + i), "step_from": a, "step_to": b, "steps": 60,
             "queue_wait_s": 2.0, "run_s": 30.0, "step_seconds": 0.5,
             "ended": "completed" if b == 60 else "continued"}
            for i, (a, b) in enumerate(((0, 25), (25, 50), (50, 60)))]


def write_record(update: Path, **more: Any) -> None:
    update.mkdir(parents=True, exist_ok=True)
    (update / "slurm_job.json").write_text(json.dumps(
        {"job_id": "102", "job_name": "xffl-r1-beta-r1", "queue_wait_s": 2.0, "run_s": 31.0,
         "exit_code": 0, **more}))


def test_three_jobs_reach_the_registry_and_status(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "registry.db")
    run = reg.create_run("r1", "r", tmp_path / "job.yaml", tmp_path / "run", 2, ["beta"])
    write_record(tmp_path / "up", **{ROUND_JOBS: chain_jobs()})
    assert record_delivered(reg, "r1", 1, "beta", tmp_path / "up")
    jobs = recorded_view(reg, run)
    assert [(j.job_id, j.state, j.step_from, j.step_to) for j in jobs] == [
        ("100", CONTINUED, 0, 25), ("101", CONTINUED, 25, 50), ("102", "COMPLETED", 50, 60)]
    assert jobs[2].name == "xffl-r1-beta-r1" and jobs[0].queue_wait_s == 2.0
    (chain,) = round_chains(run, jobs)
    assert (chain.round, chain.site, chain.jobs, chain.steps_done, chain.done) == \
        (1, "beta", 3, 60, True)


def test_a_round_in_flight_shows_steps_done_and_an_eta(tmp_path: Path) -> None:
    """Two jobs ended (at steps 25 and 50 of 60, 0.4 s a step): the third runs; 10 steps
    left at 0.4 s: an ETA of 4 s of training."""
    reg = Registry(tmp_path / "registry.db")
    run = reg.create_run("r1", "r", tmp_path / "job.yaml", tmp_path / "run", 2, ["beta"])
    record = SiteAttempts(site="beta", round=1)
    for step in (25, 50):
        assert continues(record, CONTINUE_LINE.format(round=1, step=step, steps=60)
                         + " (0.400 s/step)")
    write_attempts(RunLayout(tmp_path / "run"), record)
    (chain,) = round_chains(run, recorded_view(reg, run))
    assert (chain.jobs, chain.steps_done, chain.steps, chain.done) == (3, 50, 60, False)
    assert chain.eta_s == pytest.approx(4.0)


@pytest.mark.parametrize("change", [
    {"job_id": "../etc"}, {"step_to": 2**31}, {"step_from": -1}, {"ended": "rm -rf"},
    {"queue_wait_s": float("inf")}, {"path": "/x"}, {"step_from": 30, "step_to": 20},
    {"steps": True},
])
def test_a_hostile_list_is_left_out(tmp_path: Path, change: dict[str, Any]) -> None:
    """A facility's list with a bad entry is left out whole; the job's record still counts."""
    jobs = chain_jobs()
    jobs[1] = {**jobs[1], **change}
    write_record(tmp_path / "up", **{ROUND_JOBS: jobs})
    record = read_record(tmp_path / "up")
    assert record is not None and record["job_id"] == "102" and ROUND_JOBS not in record
    write_record(tmp_path / "up", **{ROUND_JOBS: chain_jobs() * (MAX_ROUND_JOBS // 3 + 1)})
    record = read_record(tmp_path / "up")
    assert record is not None and ROUND_JOBS not in record  # too many
    write_record(tmp_path / "up", **{ROUND_JOBS: chain_jobs()})
    record = read_record(tmp_path / "up")
    assert record is not None and len(record[ROUND_JOBS]) == 3


def test_an_older_registry_gains_the_step_columns(tmp_path: Path) -> None:
    """A registry written before chained rounds (no step columns) is migrated in place."""
    import sqlite3

    db = tmp_path / "registry.db"
    Registry(db).create_run("r1", "r", tmp_path / "job.yaml", tmp_path / "run", 2, ["beta"])
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE slurm_jobs DROP COLUMN step_from")
        conn.execute("ALTER TABLE slurm_jobs DROP COLUMN step_to")
    reg = Registry(db)
    reg.record_slurm_job("r1", 1, "beta", "7", "COMPLETED", 1.0, 2.0, steps=(0, 60))
    assert reg.slurm_jobs("r1")[0]["step_to"] == 60
