"""The round-checkpoint benchmark at tiny widths: it saves, completes and loads a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import load_bench


@pytest.mark.slow
def test_save_and_load_at_tiny_width(tmp_path: Path) -> None:
    bench = load_bench("round_checkpoint")
    overrides = {**bench.TINY, "num_hidden_layers": 1, "vocab_size": 1000,
                 "tie_word_embeddings": True, "max_position_embeddings": 2048}
    result = bench.run(overrides, tmp_path, seq=16, timeout=300)
    # fp32 weights and AdamW's two moments of every parameter, in one checkpoint
    assert result["bytes"] >= 12 * result["parameters"] and result["sync_bytes"] > 0
    for key in ("step", "sync", "blocked", "written", "load"):
        assert result[key] > 0, key
    assert result["blocked"] <= result["written"]  # training waits for part of the save
    assert result["round_fraction"] == result["blocked"] / (100 * result["step"])
    assert "| load (sha256 checked) |" in bench.table(result)
