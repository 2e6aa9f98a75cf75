"""The evaluation-overhead benchmark runs the same job with and without held-out data."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


@pytest.mark.slow
def test_both_variants_run_and_only_one_evaluates(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("evaluation_overhead")
    # the smallest runs that show the difference: 1 round, 1 step, 1 rank per site
    assert bench.main(["--repeat", "1", "--rounds", "1", "--steps", "1", "--ranks", "1",
                       "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("\n{") + 1:])
    (without,), (with_,) = result["runs"]["without"], result["runs"]["with"]
    assert without["val_loss"] == [None] and without["eval_s"] == [0.0, 0.0]
    assert with_["val_loss"][0] > 0 and all(s > 0 for s in with_["eval_s"])
    # one run each: the medians are the runs' times, and the ratio their same division
    assert result["ratio"] == with_["wall_s"] / without["wall_s"]
