"""The plan is the truth: what `xffl render` writes runs as written, and it is what submit runs.

The same job (the quickstart, shortened) rendered and run by cwltool, rendered and run by
`streamflow run`, and submitted: the final global models are the same bytes, and the
cyclic workflow submit runs is the one render wrote. The job stops early (training.stop_when)
on a validation loss that cannot improve: all three stop after the same round, since the
plan's aggregate step decides it from the run directory. cwltool and submit (StreamFlow) then
evaluate the final model (main.cwl's final steps) to the same loss; the plan `streamflow run`
runs is rendered with `evaluation.final: false` (the same rounds: the final steps come after
the loop; its two site evaluations would repeat submit's on the same engine). The submitted
run also logs every round to TensorBoard and MLflow (tracking), read back here with their own
readers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import QUICKSTART
from tests.workflows.warm_ranks import warm_profile
from xffl.cli.app import app

runner = CliRunner()
BIN = Path(sys.executable).parent


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _render(job: Path, out: Path) -> str:
    result = runner.invoke(app, ["render", str(job), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return str(json.loads(result.stdout)["run_id"])


@pytest.mark.slow
def test_cwltool_streamflow_and_submit_give_the_same_model(
        tmp_path: Path, xffl_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = yaml.safe_load(QUICKSTART.read_text())
    # 4 rounds planned, 2 run: AdamW moves each weight by about lr per step, so 2 steps at
    # lr 1e-8 move the loss by about 2 x 1e-8 x ||grad||_1 (~1e2 for this model at its
    # start) ~ 2e-6, far below min_delta: the validation loss of round 1's global does not
    # improve on round 0's, and with patience 1 the run stops after round 2
    spec.update(rounds=4, tracking={"tensorboard": "tb", "mlflow": "mlruns"})
    spec["training"].update(steps=2, lr=1e-8, stop_when={"patience": 1, "min_delta": 1e-3})
    # 160 and 128 sequences: 2 steps of 8 fit, 16 and 13 held-out windows; the sites still
    # weigh their updates differently (samples), so the global is no plain copy or mean
    # the ranks are forked from one warm interpreter (tests/workflows/warm_ranks.py: the
    # profile's XFFL_RANK_PYTHON, in the plan the three runners share)
    warm_profile(tmp_path / "site_profiles")
    for site, sequences in zip(spec["sites"], (160, 128), strict=True):
        site["ranks"] = 1
        site["profile"] = "warm-local"
        site["data"]["synthetic_sequences"] = sequences
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    no_final = tmp_path / "job-no-final.yaml"  # the same rounds, no final steps after them
    no_final.write_text(yaml.safe_dump({**spec, "evaluation": {"final": False}},
                                       sort_keys=False))

    by_cwltool, by_streamflow = tmp_path / "plan-cwltool", tmp_path / "plan-streamflow"
    _render(job, by_cwltool)
    _render(no_final, by_streamflow)
    assert not (by_cwltool / "run.json").exists()  # no registry: the plan stands alone
    # the three runs go side by side (each in its own folders; the shared synthetic corpora
    # are written atomically): they are independent, and one after another they would leave
    # a core idle while each runner waits for its steps
    commands = {"cwltool": ([str(BIN / "cwltool"), "--enable-ext", "--outdir", "out",
                             "main.cwl", "inputs.yml"], by_cwltool),
                "streamflow": ([str(BIN / "streamflow"), "run", "streamflow.yml", "--outdir",
                                "out"], by_streamflow)}
    runs = {}
    try:
        for name, (cmd, cwd) in commands.items():  # output to files: a full pipe would block
            with (tmp_path / f"{name}.out").open("w") as out, \
                    (tmp_path / f"{name}.err").open("w") as err:
                runs[name] = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err)
        result = runner.invoke(app, ["submit", str(job), "--wait", "--json", "--timeout",
                                     "300"])
        codes = {name: proc.wait(timeout=300) for name, proc in runs.items()}
    finally:
        for proc in runs.values():
            proc.kill()
    for name, code in codes.items():
        assert code == 0, (name, (tmp_path / f"{name}.err").read_text()[-3000:])
    assert json.loads((tmp_path / "cwltool.out").read_text())["next_round"] == 3
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    run_dir = Path(status["run_dir"])
    # stopped early, as completed, saying why; the same round in every plan
    assert (status["state"], status["rounds_done"], status["rounds_total"]) == \
        ("completed", 2, 4)
    assert "stopped early: the federated validation loss has not improved" in status["message"]
    for plan in (by_cwltool, by_streamflow, run_dir):
        assert json.loads((plan / "stopped.json").read_text())["round"] == 2, plan
        assert not (plan / "rounds" / "3").exists(), plan
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    _check_tracking(tmp_path, status)
    # the cyclic workflow submit ran is the one render wrote (tools name the run's paths)
    for name in ("main.cwl", "round.cwl"):
        assert (run_dir / name).read_bytes() == (by_cwltool / name).read_bytes(), name

    final = [p / "rounds" / "2" / "global" / "model.safetensors"
             for p in (by_cwltool, by_streamflow, run_dir)]
    assert len({_sha256(f) for f in final}) == 1, [_sha256(f) for f in final]
    # and each plan's last model is the run's output (cwltool and StreamFlow collect it)
    for plan in (by_cwltool, by_streamflow):
        assert _sha256(plan / "out" / "global" / "model.safetensors") == _sha256(final[0])
    # the final model's held-out loss is a step of the plan: both engines measure it, the
    # same numbers (the same bytes evaluated by the same code on the same windows, in one
    # process per site: nothing to round differently), and submit records it
    losses = [json.loads((p / "final-validation.json").read_text())
              for p in (by_cwltool, run_dir)]
    assert losses[0] == losses[1] == status["final_loss"], losses
    assert losses[0]["round"] == 2 and set(losses[0]["sites"]) == {"alpha", "beta"}
    # and main.cwl outputs it
    assert json.loads((by_cwltool / "out" / "final-validation.json").read_text()) == losses[0]
    assert not (by_streamflow / "final-validation.json").exists()  # evaluation.final: false


def _check_tracking(folder: Path, status: dict[str, Any]) -> None:
    """The submitted run's rounds, in TensorBoard's event files and MLflow's file store."""
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rounds = status["rounds"]
    events = EventAccumulator(str(folder / "tb" / status["run_id"]))
    events.Reload()
    for site in ("alpha", "beta"):
        scalars = events.Scalars(f"{site}/val_loss")
        assert [e.step for e in scalars] == [1, 2]  # one per round and site
        # TensorBoard keeps float32: the registry's float64, rounded once
        assert [e.value for e in scalars] == [
            float(np.float32(next(s["val_loss"] for s in r["sites"] if s["site"] == site)))
            for r in rounds]
    # a client of this store, not mlflow.set_tracking_uri: that would be process-wide and
    # outlive the test (a later test in this worker would read this store)
    client = mlflow.MlflowClient(tracking_uri=f"file:{folder / 'mlruns'}")
    experiment = client.get_experiment_by_name(status["name"])
    assert experiment is not None
    found = client.search_runs([experiment.experiment_id],
                               filter_string=f"tags.`xffl.run_id` = '{status['run_id']}'")
    assert len(found) == 1
    history = client.get_metric_history(found[0].info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [(r["round"], r["val_loss"]) for r in rounds]
    assert found[0].data.params["training.lr"] == "1e-08"
