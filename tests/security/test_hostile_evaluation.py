"""One site's evaluation file costs that site's row of the cross-site matrix, never the matrix.

The attack: a site returns ``evaluation-<site>.json`` with a loss that is a 400-digit whole
number. HEAD converted it with float() outside its checks: the OverflowError discarded the
whole `xffl evaluate` matrix, the honest sites' rows included.

And what the evaluation sends: a site's kept update goes to every other site, but with the
global's config bytes, never the site's own (equal as JSON, ``2.0`` for ``2``, not loadable
by transformers), and without the site's other files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICKSTART
from tests.security.hostile_site import honest_update
from tests.security.json_equal_site import rewrite
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout
from xffl.jobs.spec.schema import JobSpec
from xffl.site_profiles.lookup import find_profile
from xffl.training.checkpoint import init_global
from xffl.training.config import ModelSpec
from xffl.workflows.evaluate_run import Outcome, site_row
from xffl.workflows.plan.evaluate_tool import result_name
from xffl.workflows.plan.evaluation import EvaluationPlan, write_evaluation

MODELS = ["global", "alpha", "beta"]


def _result(site: str, losses: str) -> str:
    return f'{{"format": 1, "site": "{site}", "samples": 8, "tokens": 512, "losses": {losses}}}'


@pytest.mark.parametrize("loss", ["9" * 400, "-" + "9" * 400, "1" + "0" * 5000],
                         ids=["400-digits", "negative", "5001-digits"])
def test_a_big_integer_loss_rejects_that_row_only(tmp_path: Path, loss: str) -> None:
    plan = EvaluationPlan(round=1, models=MODELS, sites=["alpha", "beta"],
                          budgets={"alpha": 8, "beta": 8}, config=tmp_path, inputs=tmp_path,
                          seq_lens={"alpha": 64, "beta": 64})
    (tmp_path / result_name("alpha")).write_text(
        _result("alpha", json.dumps(dict.fromkeys(MODELS, 2.5))))
    (tmp_path / result_name("beta")).write_text(
        _result("beta", f'{{"global": {loss}, "alpha": 1.0, "beta": 1.0}}'))
    rows = [site_row(plan, tmp_path, s) for s in plan.sites]
    outcome = Outcome(run_id="r", round=1, models=MODELS, rows=rows, seconds=0.0)
    assert rows[0].result is not None and rows[0].result.losses == dict.fromkeys(MODELS, 2.5)
    assert rows[1].result is None and rows[1].error is not None
    assert rows[1].error.startswith("its evaluation file was rejected: ")
    assert len(rows[1].error) < 200  # the site's digits are not copied into the reason
    assert [r.site for r in outcome.failed] == ["beta"]
    assert {(c.data_site, c.model) for c in outcome.cells()} == {("alpha", m) for m in MODELS}


def test_a_kept_update_is_sent_with_the_globals_config_bytes(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "run")
    init_global("run-1", ModelSpec(preset="tiny-test"), 0, layout.global_dir(1))
    own = (layout.global_dir(1) / "config.json").read_bytes()
    for site in ("alpha", "beta"):
        honest_update(layout.global_dir(1), layout.kept_update(1, site), site, 1, "run-1")
    eve = layout.kept_update(1, "beta")
    rewrite(eve)  # JSON-equal, other bytes, the right checksum (it was admitted)
    (eve / "slurm_job.json").write_text(json.dumps({"job_id": "12"}))
    assert (eve / "config.json").read_bytes() != own
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["model"] = {"preset": "tiny-test"}
    job = JobSpec.model_validate(spec)
    profiles = {s.name: find_profile("local") for s in job.sites}

    plan = write_evaluation(layout, "run-1", job, profiles, 1)
    assert plan.models == ["global", "alpha", "beta"]
    order = yaml.safe_load(plan.inputs.read_text())
    for site in ("alpha", "beta"):
        sent = plan.inputs.parent / order[f"update_{site}"]["path"]
        assert (sent / "config.json").read_bytes() == own, site
        assert sorted(p.name for p in sent.iterdir()) == [
            "config.json", "manifest.json", "model.safetensors"]  # no slurm_job.json
        # the weights are the update's own, and the site's checks hold: checksums verify
        kept = layout.kept_update(1, site)
        assert (sent / "model.safetensors").read_bytes() == \
            (kept / "model.safetensors").read_bytes()
        manifest = verify_checkpoint(sent)
        assert (manifest.site, manifest.round, manifest.parent) == (
            site, 1, read_manifest(kept).parent)

    # a kept config that is not the global's as a JSON value is refused
    config = json.loads((eve / "config.json").read_text())
    (eve / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(InvalidInput, match=r"its config\.json is not the global model's"):
        write_evaluation(layout, "run-1", job, profiles, 1)
