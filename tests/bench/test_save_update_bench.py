"""The update-save benchmark at tiny widths: both ways run and write the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.scripts import load_bench
from tests.workflows.warm_ranks import rank_python


@pytest.mark.slow
def test_both_saves_at_tiny_width(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both saves' ranks forked from the warm rank server (the bench takes XFFL_RANK_PYTHON
    as the launcher does): the same bytes, their sizes and memory rows."""
    monkeypatch.setenv("XFFL_RANK_PYTHON", str(rank_python()))
    bench = load_bench("save_update")
    result = bench.run({**bench.TINY, "num_hidden_layers": 1, "tie_word_embeddings": True,
                        "max_position_embeddings": 2048}, tmp_path, timeout=300)
    assert result["same_bytes"] is True
    assert result["bytes"] == 4 * (1000 * 64 + 64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128
                                   + 3 * 64)
    for row in result["rows"].values():
        assert row["seconds"] > 0 and row["peak"] >= row["before"] > 0
    assert "| streamed |" in bench.table(result) and not list(tmp_path.iterdir())
