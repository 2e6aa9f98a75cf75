"""The training benchmark compares equal work: its two loops give the same loss curve."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


def test_plain_and_xffl_loops_agree(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("train_throughput")
    code = bench.main(["--steps", "3", "--warmup", "1", "--trials", "1", "--seq", "32",
                       "--batch", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["max_loss_difference"] == 0.0  # same model, data, order: the same curve
    assert result["parameters"] == 3_033_344 and result["steps"] == 3
    # the benchmark divides the same two floats (JSON round-trips them exactly): bitwise equal
    assert result["ratio"] == result["xffl_tokens_per_s"] / result["plain_tokens_per_s"]
