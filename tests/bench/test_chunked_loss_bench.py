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
    # by hand, not from the bench's own formulas: the full logits are 512 tokens x 4096 fp32
    # (8 MiB), and their forward + backward holds 3 copies; the chunked loss holds 3 of one
    # chunk's (64 x 4096 fp32) beside the head's weight and its gradient (2 x 4096 x 16 fp32)
    logits = 512 * 4096 * 4
    chunk_model = 3 * 64 * 4096 * 4 + 2 * 4096 * 16 * 4
    assert (result["full_logits_fp32_bytes"], result["model_peak_bytes"]) == (logits,
                                                                              chunk_model)
    assert full["peak_bytes"] > 3 * logits * 0.9
    # and the hidden states' copies (3 x 512 x 16 fp32), and 64 KiB of small tensors
    assert chunked["peak_bytes"] <= chunk_model + 3 * 512 * 16 * 4 + 65536
    assert result["peak_ratio"] == chunked["peak_bytes"] / full["peak_bytes"] < 0.2
