"""The evaluation-overhead benchmark runs the same job with and without held-out data.

The runs are real (``xffl submit``, the supervisor, StreamFlow, the launcher); the site's rank
Python is tests/workflows/warm_ranks.py's client (``XFFL_RANK_PYTHON`` in the environment the
local site's steps inherit): the rank is a fork of the shared server that imported torch and
the trainer once, instead of an interpreter paying ~3.3 CPU-s of imports of its own.
"""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench
from tests.workflows.warm_ranks import rank_python
from xffl.training.launch import RANK_PYTHON_ENV


@pytest.mark.slow
def test_both_variants_run_and_only_one_evaluates(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench("evaluation_overhead")
    monkeypatch.setenv(RANK_PYTHON_ENV, str(rank_python()))
    # the smallest runs that show the difference: 1 site of 1 rank, 1 round, 1 step, and no
    # final evaluation (the per-round evaluation is what differs; the bench reads nothing of
    # the final one, bench/final_evaluation measures that)
    assert bench.main(["--repeat", "1", "--rounds", "1", "--steps", "1", "--ranks", "1",
                       "--sites", "1", "--no-final", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("\n{") + 1:])
    (without,), (with_,) = result["runs"]["without"], result["runs"]["with"]
    # one update each: its manifest's eval_seconds, none without held-out data
    assert without["val_loss"] == [None] and without["eval_s"] == [0.0]
    assert with_["val_loss"][0] > 0 and len(with_["eval_s"]) == 1 and with_["eval_s"][0] > 0
    # one run each: the medians are the runs' times, and the ratio their same division
    assert result["ratio"] == with_["wall_s"] / without["wall_s"]
