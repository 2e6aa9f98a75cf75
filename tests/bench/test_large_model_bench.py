"""The large-model benchmark at a small size: real rounds, the formula check, peaks recorded."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench.scripts import load_bench
from tests.workflows.warm_ranks import rank_python
from xffl.training.launch import RANK_PYTHON_ENV


def _bench() -> ModuleType:
    return load_bench("large_model")


@pytest.mark.slow
def test_small_model_through_a_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One round (the bench's real runs have 2 or more; the formula sums rounds alike).

    The two local sites' ranks are forks of tests/workflows/warm_ranks.py's server
    (``XFFL_RANK_PYTHON``, inherited by submit, the supervisor and the launcher), not
    interpreters importing torch and the trainer (~3.3 CPU-s each) for a tensor-wise add.
    """
    bench = _bench()
    monkeypatch.setenv(RANK_PYTHON_ENV, str(rank_python()))
    result = bench.run(0.04, 1, tmp_path, timeout=300)
    assert result["state"] == "completed" and result["final_matches_formula"] is True
    # fp32 rounds each delta, each site's sum and the average once: 2 ulps a round
    assert result["worst_error_ulps"] <= 2
    assert len(result["round_s"]) == 1, result["round_s"]
    # the bench reports nan when the run recorded no coordinator peak (no 'resources' event
    # saying "peak RSS N MiB"): say that, not "nan > 0"
    peak = result["coordinator_peak_rss_gib"]
    assert not math.isnan(peak), "the run recorded no coordinator peak RSS ('resources' event)"
    assert peak > 0, peak
    # the check is not vacuous: a global that missed the round's delta (w0 itself) fails it
    ok, worst = bench.check_final(tmp_path / "w0", tmp_path / "w0", 1)
    assert not ok and worst > 100, worst


def test_model_config_sizes() -> None:
    bench = _bench()
    from xffl.training.streamed import expected_tensors

    for gib in (0.04, 4.0):
        config = bench.model_config(gib)
        size = sum(4 * math.prod(s)
                   for s in expected_tensors(config, None).values())
        assert abs(size / 2**30 - gib) / gib < 0.05


def llama_parameters(vocab_size: int, hidden_size: int, intermediate_size: int,
                     num_hidden_layers: int, num_attention_heads: int,
                     num_key_value_heads: int, **_: int) -> int:
    """A Llama's parameters by hand, untied: embedding and lm_head (V x H each), the final
    norm (H); per layer q and o (H x H), k and v (H x kv_heads x head_dim), the three MLP
    matrices (H x I) and two norms (H)."""
    head_dim = hidden_size // num_attention_heads
    kv = num_key_value_heads * head_dim
    layer = (2 * hidden_size * hidden_size + 2 * hidden_size * kv
             + 3 * hidden_size * intermediate_size + 2 * hidden_size)
    return 2 * vocab_size * hidden_size + hidden_size + num_hidden_layers * layer


def test_the_hand_count_is_llama_3_1_8bs() -> None:
    """The count above gives Meta's 8,030,261,248 for Llama 3.1 8B's shapes."""
    assert llama_parameters(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8) == 8_030_261_248


@pytest.mark.slow
def test_round0_of_the_example_job_at_small_shapes(tmp_path: Path) -> None:
    """bench/large_model/round0.py on the llama3.1-8b preset shrunk: the example job renders
    seeded and from a checkpoint folder, round 0 holds the checkpoint's values."""
    bench = load_bench("large_model", "round0.py")
    (result,) = bench.run(["llama3.1-8b"], tmp_path, small=True, max_shard_bytes=1 << 20,
                          baseline=False)  # two renders, not three: the suite's time
    assert result["values_match"] is True
    for case in ("seeded", "checkpoint"):
        assert 0 < result[case]["peak_gib"] < 2 and result[case]["s"] > 0
    assert result["parameters"] == llama_parameters(**bench.SMALL) == 2_229_504
    assert "| llama3.1-8b |" in bench.table([result])
    # every case cleaned up after itself (a 7B case leaves no 27 GB behind)
    assert not any((tmp_path / d).exists() for d in ("plan", "checkpoint", "copy", "cache"))
