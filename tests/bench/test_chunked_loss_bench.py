"""The chunked-loss benchmark measures both variants and their ratios in one run."""

from __future__ import annotations

import json

import pytest

from tests.bench.scripts import load_bench


def test_chunked_and_full_peaks_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("chunked_loss")
    assert bench.main(["--tokens", "512", "--hidden", "16", "--vocab", "4096", "--chunk",
                       "64", "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    full, chunked = result["full"], result["chunked"]
    # the full logits' forward + backward holds 3 fp32 copies; the chunks' 3 of one chunk
    assert full["peak_bytes"] > 3 * result["full_logits_fp32_bytes"] * 0.9
    assert chunked["peak_bytes"] <= result["model_peak_bytes"] + 3 * 512 * 16 * 4 + 65536
    assert result["peak_ratio"] == chunked["peak_bytes"] / full["peak_bytes"] < 0.2
