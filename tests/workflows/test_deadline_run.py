"""A real run with round_deadline: round 2 trains the steps the formula gives from round 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.workflows.warm_ranks import warm_profile
from xffl.aggregator.exchange import verify_checkpoint
from xffl.cli.app import app
from xffl.jobs.report.estimates import per_step_seconds

runner = CliRunner()
DEADLINE = 2.0  # seconds


@pytest.mark.slow
def test_round_two_steps_fit_the_deadline(tmp_path: Path, xffl_home: Path) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["evaluation"] = {"final": False}  # test_final_evaluation
    spec.update(name="deadline", rounds=2)
    # one rank per site and 4 steps in round 1 (its measures are all round 2 needs): the
    # fitted budget is under test, not DDP (4 rank start-ups instead of 8); both sites, so
    # that a site fitted from the other's measures shows; the ranks are forked from one warm
    # interpreter (their start-up is then shorter, and measured all the same)
    spec["training"].update(steps=4)
    for site in spec["sites"]:
        site["ranks"] = 1
        site["profile"] = "warm-local"  # tests/workflows/warm_ranks.py
    # round 2 trains about (seconds - start-up) at each site: its CPU time grows with the
    # deadline (late: wait, so nothing here is timed: a loaded machine fits fewer steps)
    spec["round_deadline"] = {"seconds": DEADLINE, "min_steps": 2, "max_steps": 400,
                              "startup": 1}  # below the deadline; round 1 plans its 4 steps
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    warm_profile(tmp_path / "site_profiles")
    result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout", "300"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    run_dir = Path(status["run_dir"])
    first = {s["site"]: s for s in status["rounds"][0]["sites"]}
    for site in ("alpha", "beta"):
        # round 1's measures are the estimates' first values (no SLURM: no queue wait)
        per_step = per_step_seconds(run_dir, 1, site)
        assert per_step is not None
        left = DEADLINE - 0.0 - first[site]["startup_s"]
        expected = max(2, min(400, math.floor(max(0.0, left) / per_step)))
        written = json.loads((run_dir / "rounds" / "2" / "jobs" / f"{site}.json").read_text())
        assert written["training"]["steps"] == expected
        trained = verify_checkpoint(run_dir / "rounds" / "2" / "updates" / site)
        assert trained.metrics["steps"] == expected  # the trainer obeyed the fitted budget
    assert [e["rounds_seen"] for e in status["estimates"]] == [2, 2]
