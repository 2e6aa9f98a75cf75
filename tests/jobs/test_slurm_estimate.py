"""SLURM's own queue-wait estimate, from a real ``sbatch --test-only`` on the test stack.

One CPU-exclusive blocking job holds alpha's only node; a round's job could then start only
when the blocker's time limit ends, and SLURM says so. The estimate is compared with what
SLURM itself records as the blocker's end, never with this machine's clock.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.stack.profiles import write_profile
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import site_estimates
from xffl.jobs.slurm_estimate import estimate_command, parse_test_only, seed_estimates
from xffl.jobs.slurm_view import ssh_run
from xffl.site_profiles.schema import SiteProfile

BLOCKER_LIMIT_S = 300  # the blocking job's --time: no round job starts before it ends


def test_the_estimate_is_slurms_start_after_a_blocking_job(
        tmp_path: Path, slurm_stack: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", slurm_stack.ssh_home)
    name = write_profile(tmp_path, slurm_stack.clusters["alpha"], slurm_stack)
    profile = SiteProfile.model_validate(yaml.safe_load((tmp_path / f"{name}.yaml").read_text()))
    assert profile.slurm is not None
    blocker = slurm_stack.ssh("alpha", "sbatch --parsable --exclusive --job-name=xffl-blocker "
                              f"--time=00:0{BLOCKER_LIMIT_S // 60}:00 --wrap='sleep 600'",
                              timeout=30, check=True).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while slurm_stack.ssh("alpha", f"squeue -h -j {blocker} -o %T", timeout=30
                              ).stdout.strip() != "RUNNING":  # its end is known once it runs
            assert time.monotonic() < deadline, "the blocking job never started"
            time.sleep(0.2)
        rc, out, _ = ssh_run(profile, estimate_command(profile.slurm, 1))
        shown = slurm_stack.ssh("alpha", f"scontrol -o show job {blocker}", timeout=30,
                                check=True).stdout
        end = re.search(r"\bEndTime=(\S+)", shown)
        assert rc == 0 and end is not None, (out, shown)
        now = datetime.fromisoformat(out.splitlines()[0])
        # SLURM starts the round's job when the blocker's limit ends, to the second
        assert parse_test_only(out) == (datetime.fromisoformat(end.group(1)) - now).total_seconds()
        assert 0 < parse_test_only(out) <= BLOCKER_LIMIT_S  # type: ignore[operator]
        # the seed goes to the registry and starts the site's queue-wait average
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "profiles.json").write_text(json.dumps(
            {"alpha": profile.model_dump(mode="json")}))
        reg = Registry(tmp_path / "registry.db")
        run = reg.create_run("r1", "r", tmp_path / "job.yaml", run_dir, 2, ["alpha"])
        seeds = seed_estimates(reg, run, {"alpha": 1})
        assert 0 < seeds["alpha"] <= BLOCKER_LIMIT_S
        (est,) = site_estimates(reg, run)
        assert est.queue_wait_s == est.slurm_estimate_s == seeds["alpha"]
        assert est.rounds_seen == 0 and est.seconds_per_step is None
    finally:
        slurm_stack.ssh("alpha", f"scancel {blocker}", timeout=30)
