"""One site's validation numbers cannot stop a run early, nor keep it from stopping.

The attack: a site reports the held-out loss of the global it received (``val_loss``), which
the aggregate step combines into the federated validation loss that ``training.stop_when``
reads. HEAD admitted any finite value up to 1e12 and stopped on the token-weighted mean, so
one site decided the stop: a falling 1e12, 1e11, ... kept a plateaued run going, and a 0
then a 1e12 stopped an improving one. Here four rounds of a rendered plan (two honest sites
and ``eve``, failure.min_sites 2, stop_when patience 1) run through the real admit and
aggregate steps (workflows/steps/admit.py, aggregate.py), with the bounds the plan passes
the admit step: a loss above 3 x ln(vocabulary) is a rejection of that site's update, and
the stop reads the median across the admitted sites' losses, which one liar among three
cannot move outside the honest sites' range.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import QUICKSTART
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.reported import Bounds, max_val_loss
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps import aggregate
from xffl.workflows.steps.admit import SIDE_FILES, admit
from xffl.workflows.steps.bounds import report_bounds
from xffl.workflows.steps.early_stop import read_stopped

runner = CliRunner()
VOCAB = 64  # ln 64 = 4.159: a loss above 3 ln 64 = 12.477 is refused
CONFIG = {"hidden_size": 8, "vocab_size": VOCAB}
HONEST = {"plateau": [3.0, 3.0, 3.0, 3.0], "improving": [3.0, 2.5, 2.0, 1.5]}
# (the honest sites' series, eve's, the round after which the run stops: None, it runs all 4)
ATTACKS = {
    "1e12 keeps a plateau going": ("plateau", [1e12, 1e11, 1e10, 1e9], 2),
    "0 then 1e12 stops an improving run": ("improving", [0.0, 1e12, 1e12, 1e12], None),
    # within the bound: the mean would be 2.0 then 5.67 (a stop after round 2); the median
    # of (honest, honest, eve) is the honest value whatever eve says
    "within the bound, 0 and 12": ("improving", [0.0, 12.0, 0.0, 12.0], None),
}


def _plan(tmp_path: Path) -> RunLayout:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["rounds"] = 4
    spec["training"]["stop_when"] = {"patience": 1, "min_delta": 0.01}
    spec["failure"] = {"min_sites": 2}
    eve = {**spec["sites"][1], "name": "eve"}
    spec["sites"].append(eve)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["render", str(job), "-o", str(tmp_path / "run"),
                                 "--no-init-model"])
    assert result.exit_code == 0, result.output
    layout = RunLayout(tmp_path / "run")
    write_checkpoint(layout.global_dir(0), {"w": torch.zeros(4)}, kind="global", site=None,
                     round=0, run_id="run-1", config=CONFIG)
    return layout


def _round(tmp_path: Path, layout: RunLayout, rnd: int, losses: dict[str, float],
           monkeypatch: pytest.MonkeyPatch) -> bool:
    """Round ``rnd``: each site sends an update reporting ``losses[site]`` as its val_loss;
    the admit step judges it, the aggregate step aggregates; returns the loop's ``go``."""
    spec = JobSpec.of_run(layout.root)
    previous = layout.global_dir(rnd - 1)
    parent = read_manifest(previous)
    work = tmp_path / "steps" / str(rnd)
    work.mkdir(parents=True)
    argv = ["--run-dir", str(layout.root), "--round", str(rnd), "--max-rounds", "4",
            "--sites", ",".join(losses), "--previous", str(previous)]
    for site in spec.sites:
        tokens, samples, held_out, seq_len = report_bounds(spec, site)  # the plan's args
        assert held_out is not None and seq_len is not None
        update = write_checkpoint(
            work / f"sent-{site.name}", {"w": torch.full((4,), float(rnd))}, site=site.name,
            round=rnd, parent=parent.digest(), run_id=parent.run_id, num_samples=8,
            config=CONFIG, metrics={"val_loss": losses[site.name],
                                    "val_loss_update": min(losses[site.name], 1.0),
                                    "val_samples": 1, "val_tokens": seq_len})
        verdict, _ = admit(layout, site.name, rnd, previous, update, Bounds(
            max_tokens=tokens, max_samples=samples, side_files=SIDE_FILES,
            max_val_samples=held_out, val_seq_len=seq_len))
        if losses[site.name] > max_val_loss(VOCAB):
            assert verdict.state == SiteState.REJECTED, verdict
            assert verdict.reason.startswith(f"metric 'val_loss' is {losses[site.name]!r}, "
                                             "more than 3 x ln(64) = 12.4766"), verdict.reason
        else:
            assert verdict.state == SiteState.COMPLETED, verdict.reason
            argv.append(f"--update={site.name}={update}")
        verdict.write(work / f"{site.name}.json")
        argv += [f"--verdict={site.name}={work / f'{site.name}.json'}",
                 f"--job={site.name}={layout.job_file(site.name)}"]
    out = tmp_path / "out" / str(rnd)
    out.mkdir(parents=True)
    monkeypatch.chdir(out)
    assert aggregate.main(argv) == 0  # a rejected site never fails the round
    go: bool = json.loads((out / "cwl.output.json").read_text())["go"]
    return go


@pytest.mark.parametrize("attack", ATTACKS)
def test_one_sites_validation_loss_does_not_decide_the_stop(
        tmp_path: Path, attack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    honest, eve, stops = ATTACKS[attack]
    layout = _plan(tmp_path)
    stopped_after = None
    for rnd in range(1, 5):
        value = HONEST[honest][rnd - 1]
        go = _round(tmp_path, layout, rnd, {"alpha": value, "beta": value, "eve": eve[rnd - 1]},
                    monkeypatch)
        recorded = json.loads(layout.validation_file(rnd).read_text())
        assert recorded["val_loss_median"] == value  # the honest sites' value
        assert math.isfinite(recorded["val_loss"])
        if not go:
            stopped_after = rnd
            break
    assert stopped_after == (stops or 4), (attack, stopped_after)
    stopped = read_stopped(layout)
    assert (stopped.round if stopped else None) == stops, stopped
    if stopped is not None:
        assert "on the median across sites" in stopped.reason
