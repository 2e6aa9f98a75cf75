"""The edge of ``maxRounds``: xffl-slurm adopts a job exactly ``maxRounds`` rounds late, and
scancels one a round later (the stack test, tests/workflows/extensions/test_slurm.py, adopts
one round late and scancels three rounds late: it cannot tell ``<=`` from ``<``).

The connector is xffl's own, over StreamFlow's local connector in place of the login node's
ssh: its ``scancel`` is the test's own on PATH, which notes the job ids it was given (no
SLURM here; the real ``scancel`` of a late job is the stack test's).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from streamflow.core.deployment import ExecutionLocation
from streamflow.deployment.connector.local import LocalConnector

from xffl.core.layout import RunLayout
from xffl.workflows.extensions.connectors import XfflSlurmConnector
from xffl.workflows.steps.late import LateJob, leave_late, read_late

MAX_ROUNDS = 2
STARTED = 3  # the late job's round


def _adoptable(tmp_path: Path, rnd: int) -> LateJob | None:
    """What the connector of site beta (``maxRounds`` MAX_ROUNDS) makes of the job left late
    in round STARTED when round ``rnd``'s train step starts."""
    inner = LocalConnector(deployment_name="login-b", config_dir=str(tmp_path))
    conn = XfflSlurmConnector(deployment_name="site-b", config_dir=str(tmp_path),
                              connector=inner, service=None, pollingInterval=1,
                              maxConcurrentJobs=1,
                              late={"runDir": str(tmp_path / "run"), "site": "beta",
                                    "maxRounds": MAX_ROUNDS})
    login = ExecutionLocation(name="__LOCAL__", deployment="login-b", local=True)
    site = ExecutionLocation(name="site-b", deployment="site-b", wraps=login)
    return asyncio.run(conn._adoptable(site, rnd))


@pytest.fixture
def scancelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file where the test's ``scancel`` (first on PATH) notes its arguments."""
    bin_dir, noted = tmp_path / "bin", tmp_path / "scancelled"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {noted}\n')
    (bin_dir / "scancel").chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return noted


@pytest.mark.parametrize(("late_by", "adopted"), [
    (1, True), (MAX_ROUNDS, True),  # within maxRounds, its edge included
    (MAX_ROUNDS + 1, False),        # beyond it: scancelled, forgotten, a job of its own
])
def test_a_job_late_by_max_rounds_is_adopted_and_one_more_is_scancelled(
        tmp_path: Path, scancelled: Path, late_by: int, adopted: bool) -> None:
    layout = RunLayout(tmp_path / "run")
    job = LateJob(site="beta", job_id="4242", round=STARTED, workdir="/scratch/r3")
    leave_late(layout, job)
    got = _adoptable(tmp_path, STARTED + late_by)
    if adopted:
        assert got is not None and (got.job_id, got.round) == ("4242", STARTED), \
            f"{late_by} round(s) late (maxRounds {MAX_ROUNDS}): not adopted"
        assert read_late(layout, "beta") is not None and not scancelled.exists()
    else:
        assert got is None, f"{late_by} round(s) late (maxRounds {MAX_ROUNDS}): adopted"
        assert read_late(layout, "beta") is None
        assert scancelled.read_text().split() == ["4242"]
