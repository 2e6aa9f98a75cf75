"""Round budgets fit to a deadline: exact steps from the estimates; bad deadlines refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from xffl.cli.app import app
from xffl.jobs.registry.records import RoundRecord, SiteRound
from xffl.jobs.registry.states import RoundState, SiteState
from xffl.jobs.registry.store import Registry
from xffl.jobs.report.estimates import SiteEstimate
from xffl.jobs.spec.deadline import RoundDeadline, StalenessSpec
from xffl.jobs.spec.schema import JobSpec
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.workflows.plan.compile import report_bounds
from xffl.workflows.steps.deadline import deadline_jobs, fit_steps

runner = CliRunner()


def test_fit_steps_by_hand() -> None:
    d = RoundDeadline(seconds=600, min_steps=5, max_steps=200)
    # (600 - 300 queue - 20 start-up) / 2 s per step = 140 steps
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 300.0, 20.0, 2.0), 60.0) == 140
    # (600 - 0 - 60 prior start-up) / 2 = 270, capped at max_steps
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 0.0, None, 2.0), 60.0) == 200
    # a queue longer than the deadline: min_steps, however late
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 900.0, 20.0, 2.0), 60.0) == 5
    # not measured yet: the configured 50, within the bounds
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 300.0), 60.0) == 50
    # no max_steps: configured x balance_max = 50 x 1.5 = 75
    free = RoundDeadline(seconds=600)
    assert fit_steps(free, 50, 1.5, SiteEstimate("a", 0.0, 0.0, 1.0), 60.0) == 75
    # a tiny step time never overflows
    assert fit_steps(free, 50, 1.5, SiteEstimate("a", 0.0, 0.0, 1e-300), 60.0) == 75


def test_a_site_that_cannot_make_the_deadline_fits_the_first_one_it_can_under_adopt() -> None:
    """late: adopt: a site whose queue alone passes the deadline will be adopted by a later
    round anyway, so its steps fit the first deadline it can make, k x seconds from its
    submission: 900 s queue + 20 s start-up + 5 steps x 2 s = 930 s -> k = ceil(930 / 600)
    = 2, (1200 - 920) / 2 = 140 steps (late: wait gives it min_steps, as above)."""
    d = RoundDeadline(seconds=600, min_steps=5, max_steps=200, late="adopt")
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 900.0, 20.0, 2.0), 60.0) == 140
    # one that makes this deadline fits it as under late: wait
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 300.0, 20.0, 2.0), 60.0) == 140
    # 1185 s before its first step: k = ceil((1185 + 10) / 600) = 2, (1200 - 1185) / 2 -> 7
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 1165.0, 20.0, 2.0), 60.0) == 7
    # 1195 s: 5 steps would end at 1205 > 1200, so k = 3: (1800 - 1195) / 2 = 302 -> 200
    assert fit_steps(d, 50, 4.0, SiteEstimate("a", 1175.0, 20.0, 2.0), 60.0) == 200


def test_staleness_weights() -> None:
    assert StalenessSpec(function="constant").weight(3) == 1.0
    assert StalenessSpec(function="polynomial", a=0.5).weight(3) == 0.5  # (1 + 3)^-0.5
    assert StalenessSpec(function="exponential", a=1.0).weight(2) == math.exp(-2.0)
    assert StalenessSpec().weight(0) == 1.0


def test_deadline_jobs_from_a_recorded_run(tmp_path: Path) -> None:
    """Round 3's job files from rounds 1-2 as the registry and the kept manifests hold them."""
    root = tmp_path / "run"
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["round_deadline"] = {"seconds": 100, "min_steps": 2, "max_steps": 60}
    job_spec = JobSpec.model_validate(spec)
    for site in ("alpha", "beta"):
        job = TrainJob(run_id="r1", site=site, model=ModelSpec(),
                       training=TrainingSpec(steps=10), data=DataSpec(path="d"))
        (root / "jobs").mkdir(parents=True, exist_ok=True)
        (root / "jobs" / f"{site}.json").write_text(job.model_dump_json())
    reg = Registry(tmp_path / "registry.db")
    run = reg.create_run("r1", "r", tmp_path / "job.yaml", root, 5, ["alpha", "beta"])
    # alpha: queue 40 then 20 (EWMA 30), start-up 10, 1 s/step; beta: no SLURM (0), 0.5 s/step
    for rnd, alpha_wait in ((1, 40.0), (2, 20.0)):
        reg.start_round(run.id, rnd, ["alpha", "beta"])
        for site in ("alpha", "beta"):
            update = root / "rounds" / str(rnd) / "updates" / site
            update.mkdir(parents=True)
            (update / "manifest.json").write_text(json.dumps(
                {"metrics": {"steps": 10.0, "train_seconds": 10.0 if site == "alpha" else 5.0}}))
        reg.record_slurm_job(run.id, rnd, "alpha", f"{rnd}", "COMPLETED", alpha_wait, 20.0)
        reg.finish_round(run.id, RoundRecord(round=rnd, state=RoundState.COMPLETED, sites=[
            SiteRound(site="alpha", state=SiteState.COMPLETED, startup_seconds=10.0),
            SiteRound(site="beta", state=SiteState.COMPLETED, startup_seconds=2.0)]))
    files = deadline_jobs(root, 3, job_spec, reg, run.id)
    steps = {s: json.loads((root / f).read_text())["training"]["steps"] for s, f in files.items()}
    # alpha: (100 - 30 - 10) / 1 = 60; beta: (100 - 0 - 2) / 0.5 = 196, capped at 60 -> 60
    assert steps == {"alpha": 60, "beta": 60}
    assert files["alpha"] == "rounds/3/jobs/alpha.json"
    reg.record_slurm_job(run.id, 2, "alpha", "2", "COMPLETED", 140.0, 20.0)  # waits grew
    files = deadline_jobs(root, 3, job_spec, reg, run.id)
    # alpha: EWMA 40 -> 90; (100 - 90 - 10) / 1 = 0 -> min_steps 2
    assert json.loads((root / files["alpha"]).read_text())["training"]["steps"] == 2


def _refused(tmp_path: Path, change: dict, line_of: str) -> str:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec.update(change)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    line = next(i for i, text in enumerate(job.read_text().splitlines(), 1) if line_of in text)
    first = result.stderr.strip().splitlines()[0].removeprefix("error: ")
    assert first.startswith(f"{job}:{line}: job spec field "), first
    assert not (tmp_path / "runs").exists()
    return first


@pytest.mark.parametrize(("change", "line_of", "says"), [
    ({"round_deadline": {"seconds": 30}}, "seconds: 30",
     "round_deadline.seconds: the round deadline of 30 s is not longer than the start-up of "
     "site 'alpha' (60 s)"),
    ({"round_deadline": {"seconds": 600, "min_steps": 50, "max_steps": 10}}, "max_steps: 10",
     "round_deadline.max_steps: max_steps 10 is below min_steps 50"),
    ({"round_deadline": {"seconds": 600, "staleness": {"function": "hyperbolic"}}},
     "function: hyperbolic", "round_deadline.staleness.function: input should be"),
])
def test_bad_deadlines_exit_2_naming_file_line_and_field(
        tmp_path: Path, change: dict, line_of: str, says: str) -> None:
    assert says in _refused(tmp_path, change, line_of)


def test_a_sites_own_startup_longer_than_the_deadline(tmp_path: Path) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["sites"][1]["startup"] = 900
    first = _refused(tmp_path, {"sites": spec["sites"], "round_deadline": {"seconds": 600}},
                     "startup: 900")
    assert ("sites[1].startup: the round deadline of 600 s is not longer than the start-up of "
            "site 'beta' (900 s)") in first


def test_admission_allows_the_most_steps_a_deadline_may_fit() -> None:
    """The admit step's token bound covers a deadline's most steps: an update trained to the
    fitted steps is not refused as over its budget (the quickstart's 30 steps x 8 x 64 x 2
    ranks = 30,720 tokens; a deadline may raise them to max_steps = 100)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["round_deadline"] = {"seconds": 600, "max_steps": 100}
    job_spec = JobSpec.model_validate(spec)
    site = job_spec.sites[0]
    assert report_bounds(job_spec, site)[0] == 100 * 8 * 64 * 2
    spec["round_deadline"] = {"seconds": 600}  # max_steps: 30 x balance_max (4.0) = 120
    assert report_bounds(JobSpec.model_validate(spec), site)[0] == 120 * 8 * 64 * 2
    del spec["round_deadline"]
    assert report_bounds(JobSpec.model_validate(spec), site)[0] == 30 * 8 * 64 * 2
