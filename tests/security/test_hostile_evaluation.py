"""One site's evaluation file costs that site's row of the cross-site matrix, never the matrix.

The attack: a site returns ``evaluation-<site>.json`` with a loss that is a 400-digit whole
number. HEAD converted it with float() outside its checks: the OverflowError discarded the
whole `xffl evaluate` matrix, the honest sites' rows included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xffl.workflows.evaluate_plan import EvaluationPlan, result_name
from xffl.workflows.evaluate_run import Outcome, site_row

MODELS = ["global", "alpha", "beta"]


def _result(site: str, losses: str) -> str:
    return f'{{"format": 1, "site": "{site}", "samples": 8, "losses": {losses}}}'


@pytest.mark.parametrize("loss", ["9" * 400, "-" + "9" * 400, "1" + "0" * 5000],
                         ids=["400-digits", "negative", "5001-digits"])
def test_a_big_integer_loss_rejects_that_row_only(tmp_path: Path, loss: str) -> None:
    plan = EvaluationPlan(round=1, models=MODELS, sites=["alpha", "beta"],
                          budgets={"alpha": 8, "beta": 8}, config=tmp_path, inputs=tmp_path)
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
