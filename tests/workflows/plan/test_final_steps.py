"""The final model's held-out loss is part of the plan: main.cwl's steps after the loop (each
site's evaluation of the last global, then the coordinator's combination), written by render,
run by submit, `streamflow run` and cwltool alike; absent when the job turns it off or cannot
evaluate its final model. (A real run whose site's final evaluation dies, after a first cron
tick that does not run it: tests/workflows/test_other_format_round.py, sharing that run.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART
from xffl.core.files import write_json
from xffl.jobs.registry.attempts import SiteAttempts, write_attempts
from xffl.jobs.spec.load import load_job
from xffl.workflows.plan.compile import write_plan
from xffl.workflows.plan.validate import validate_cwl
from xffl.workflows.steps.final_validation import main as final_step


def _job(tmp_path: Path, spec: dict[str, object]) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def test_main_cwl_holds_the_final_evaluation(tmp_path: Path, xffl_home: Path) -> None:
    """After the loop: every site evaluates the loop's last global with its last job file
    (its evaluate tool, the one `xffl evaluate` runs), bound where it trains; the coordinator
    combines; all only when the run is over (a cron tick's one round is not)."""
    layout = write_plan(load_job(QUICKSTART), "qs-1", tmp_path / "plan")
    validate_cwl(layout.main)  # cwltool accepts the conditional steps
    main = yaml.safe_load(layout.main.read_text())
    steps = main["steps"]
    assert set(steps) == {"rounds", "final_evaluate_alpha", "final_evaluate_beta",
                          "final_validation"}
    assert {"last_round", "over"} <= set(steps["rounds"]["out"])
    for site in ("alpha", "beta"):
        step = steps[f"final_evaluate_{site}"]
        assert step["run"] == f"tools/evaluate_{site}.cwl"
        assert step["when"] == "$(inputs.over)"  # a parameter reference: no JavaScript
        assert step["in"] == {"round": "rounds/last_round", "over": "rounds/over",
                              "model_global": "rounds/model", "job": f"rounds/job_{site}"}
        tool = yaml.safe_load(layout.tool(f"evaluate_{site}").read_text())
        assert "xffl.training.evaluate_models" in tool["arguments"]
    assert steps["final_validation"]["in"]["evaluation_beta"] == "final_evaluate_beta/evaluation"
    assert main["outputs"]["final_validation"] == {
        "type": "File?", "outputSource": "final_validation/validation"}
    aggregate = yaml.safe_load(layout.tool("aggregate").read_text())
    assert {"last_round", "over"} <= set(aggregate["outputs"])

    # turned off, or not applicable (a site without held-out data): no such steps, no tools
    for change in ({"evaluation": {"final": False}}, {"sites": "beta without validation"}):
        spec = yaml.safe_load(QUICKSTART.read_text())
        if "sites" in change:
            del spec["sites"][1]["data"]["validation"]
        else:
            spec.update(change)
        plan = write_plan(load_job(_job(tmp_path, spec)), "qs-2", tmp_path / "off")
        main = yaml.safe_load(plan.main.read_text())
        assert set(main["steps"]) == {"rounds"}, change
        assert "final_validation" not in main["outputs"]
        assert not list(plan.tools.glob("evaluate_*.cwl")) and not plan.tool(
            "final_validation").exists()
        assert "over" not in yaml.safe_load(plan.round_cwl.read_text())["outputs"]
        sf = yaml.safe_load(plan.streamflow.read_text())
        assert "final" not in sf["failureManager"]["config"]
        assert not [b for b in sf["workflows"]["qs-2"]["bindings"]
                    if b["step"].startswith("/final")]


def _result(site: str, samples: int, loss: float) -> dict[str, object]:
    return {"format": 1, "site": site, "samples": samples, "tokens": samples * 64,
            "losses": {"global": loss}}


def test_the_final_step_combines_what_came_back_and_names_what_did_not(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """beta's file is combined; alpha's evaluation was given up by the failure manager (no
    file: its recorded reason is named); a file beyond the job's evaluation budget is
    rejected and named, never combined."""
    layout = write_plan(load_job(QUICKSTART), "qs-1", tmp_path / "plan")
    monkeypatch.chdir(tmp_path)
    write_json(tmp_path / "beta.json", _result("beta", 13, 3.25))
    write_attempts(layout, SiteAttempts(site="alpha", round=3, gave_up=True, final=True,
                                        failures=["attempt 1: no held-out data"]))
    args = ["--run-dir", str(layout.root), "--round", "3", "--sites", "alpha,beta"]
    assert final_step([*args, f"--evaluation=beta={tmp_path / 'beta.json'}"]) == 0
    written = json.loads(layout.final_validation.read_text())
    assert written == {"round": 3, "val_loss": 3.25, "val_loss_median": 3.25,
                       "val_samples": 13, "val_tokens": 13 * 64, "sites": {"beta": 3.25},
                       "site_tokens": {"beta": 13 * 64}}
    assert json.loads((tmp_path / "final-validation.json").read_text()) == written  # output
    said = capsys.readouterr().err
    assert ("the final model's held-out loss is 3.2500, without site alpha: the evaluation at "
            "the site failed: attempt 1: no held-out data") in said

    # the quickstart's budget: 16 batches of 8 held-out sequences; 10**6 would outweigh any
    # honest site's mean by far
    layout.final_validation.unlink()
    write_json(tmp_path / "alpha.json", _result("alpha", 10**6, 0.0))
    assert final_step([*args, f"--evaluation=alpha={tmp_path / 'alpha.json'}",
                       f"--evaluation=beta={tmp_path / 'beta.json'}"]) == 0
    written = json.loads(layout.final_validation.read_text())
    assert written["sites"] == {"beta": 3.25} and written["val_loss"] == 3.25
    assert "site alpha: its evaluation file was rejected: samples is 1000000, outside 1..128" \
        in capsys.readouterr().err

    # the runner's staging link is followed, a link the site sent is not (here to a file of
    # the coordinator's that passes every check: it would be combined if followed)
    (tmp_path / "site-made.json").symlink_to(tmp_path / "beta.json")
    (tmp_path / "staged.json").symlink_to(tmp_path / "site-made.json")
    layout.final_validation.unlink()
    assert final_step([*args, f"--evaluation=beta={tmp_path / 'staged.json'}"]) == 0
    assert not layout.final_validation.exists()
    assert "site beta: its evaluation file was rejected: unreadable evaluation file" in \
        capsys.readouterr().err

    # whatever goes wrong in the step itself (here an unreadable job.json), the rounds are
    # done: it says why and ends well, so the run completes
    layout.job_json.write_text("{")
    assert final_step([*args, f"--evaluation=beta={tmp_path / 'beta.json'}"]) == 0
    assert "the final model's held-out loss was not measured: " in capsys.readouterr().err
