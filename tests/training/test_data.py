"""Token shards: synthetic corpora, the on-disk format and the data-parallel sampler."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xffl.core.errors import InvalidInput
from xffl.training.data import (
    LANGUAGES,
    TokenShards,
    ensure_synthetic,
    index_batches,
    load_tokens,
    num_samples,
    rank_indices,
    read_meta,
)


def test_synthetic_is_deterministic_across_processes(tmp_path: Path) -> None:
    ensure_synthetic(tmp_path / "a", "alpha", 40, 31)
    # A fresh interpreter with a different hash seed must write the very same bytes.
    code = ("import sys; from xffl.training.data import ensure_synthetic; "
            "ensure_synthetic(sys.argv[1], 'alpha', 40, 31)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, env=env)
    assert (tmp_path / "a/train.bin").read_bytes() == (tmp_path / "b/train.bin").read_bytes()
    meta = json.loads((tmp_path / "a/meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == 40 * 32
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes"
    assert (tmp_path / "a/train.bin").stat().st_size == 40 * 32 * 2


def _bigram_counts(tokens: np.ndarray) -> collections.Counter[tuple[int, int]]:
    return collections.Counter(zip(tokens[:-1].tolist(), tokens[1:].tolist(), strict=True))


def test_languages_are_different_distributions(tmp_path: Path) -> None:
    streams = {}
    for name in LANGUAGES:
        ensure_synthetic(tmp_path / name, name, 200, 63)
        streams[name] = np.asarray(load_tokens(tmp_path / name))
    alpha, beta = streams["alpha"], streams["beta"]
    assert alpha.max() < 128 and beta.max() < 128  # ASCII bytes
    # Byte unigram distributions are far apart (total variation distance).
    pa = np.bincount(alpha, minlength=256) / len(alpha)
    pb = np.bincount(beta, minlength=256) / len(beta)
    assert 0.5 * np.abs(pa - pb).sum() > 0.5
    # Every language differs from every other in its frequent bigrams.
    tops = {n: {b for b, _ in _bigram_counts(s).most_common(20)} for n, s in streams.items()}
    for a in tops:
        for b in tops:
            if a < b:
                assert len(tops[a] & tops[b]) < 10, (a, b)


def test_ensure_synthetic_is_a_no_op_when_present(tmp_path: Path) -> None:
    ensure_synthetic(tmp_path, "beta", 10, 15)
    before = (tmp_path / "train.bin").stat().st_mtime_ns, (tmp_path / "meta.json").stat()
    ensure_synthetic(tmp_path, "beta", 10, 15)
    after = (tmp_path / "train.bin").stat().st_mtime_ns, (tmp_path / "meta.json").stat()
    assert before == after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin"]
    ensure_synthetic(tmp_path, "beta", 20, 15)  # other parameters: regenerated
    assert num_samples(tmp_path, 15) == 20


def test_ensure_synthetic_never_overwrites_real_data(tmp_path: Path) -> None:
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "num_tokens": 100}))
    with pytest.raises(InvalidInput, match="refusing"):
        ensure_synthetic(tmp_path, "alpha", 10, 15)
    assert np.array_equal(load_tokens(tmp_path), np.arange(100))


def test_load_tokens_checks_size_against_meta(tmp_path: Path) -> None:
    ensure_synthetic(tmp_path, "alpha", 4, 15)
    with (tmp_path / "train.bin").open("r+b") as fh:
        fh.truncate(10)
    with pytest.raises(InvalidInput, match="promises"):
        load_tokens(tmp_path)
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(InvalidInput, match="dtype"):
        read_meta(tmp_path)
    # a folder that is not there says so (not "no meta.json"), and where a relative one is
    with pytest.raises(InvalidInput, match=r"no such folder.*under the site profile's workdir"):
        read_meta(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match=r"no meta\.json"):
        read_meta(tmp_path / "empty")


@pytest.mark.parametrize(("n", "dp"), [(10, 1), (10, 2), (11, 2), (13, 4)])
def test_rank_shards_are_disjoint_and_cover(n: int, dp: int) -> None:
    for epoch in range(3):
        parts = [rank_indices(n, r, dp, seed=7, round=2, epoch=epoch) for r in range(dp)]
        assert all(len(p) == n // dp for p in parts)  # equal steps on every rank
        union = np.concatenate(parts)
        assert len(set(union.tolist())) == len(union)  # disjoint
        assert len(union) == n - n % dp  # covering all but the remainder
        assert set(union.tolist()) <= set(range(n))


def test_shuffle_depends_on_seed_round_epoch_only() -> None:
    base = rank_indices(64, 0, 2, seed=1, round=1, epoch=0)
    assert np.array_equal(base, rank_indices(64, 0, 2, seed=1, round=1, epoch=0))
    for other in ({"seed": 2, "round": 1, "epoch": 0}, {"seed": 1, "round": 2, "epoch": 0},
                  {"seed": 1, "round": 1, "epoch": 1}):
        assert not np.array_equal(base, rank_indices(64, 0, 2, **other))


def test_batches_walk_whole_epochs() -> None:
    # 10 sequences, 2 ranks, batch 3: each rank sees its 5 sequences per epoch, then the next
    # epoch's 5, and batches straddle the epoch boundary.
    it = index_batches(10, 3, dp_rank=1, dp_size=2, seed=0, round=0)
    got = np.concatenate([next(it) for _ in range(5)])
    want = np.concatenate([rank_indices(10, 1, 2, 0, 0, e) for e in range(3)])[:15]
    assert np.array_equal(got, want)
    with pytest.raises(InvalidInput, match="fewer"):
        next(index_batches(1, 1, 0, 2, 0, 0))


def test_token_shards_batches_are_shifted_windows(tmp_path: Path) -> None:
    ensure_synthetic(tmp_path, "gamma", 12, 15)
    shards = TokenShards(tmp_path, 15)
    assert len(shards) == 12 == num_samples(tmp_path, 15)
    raw = np.asarray(load_tokens(tmp_path)).astype(np.int64)
    inputs, targets = shards.batch(np.array([3, 0]))
    assert inputs.shape == targets.shape == (2, 15)
    assert inputs[0].tolist() == raw[48:63].tolist()
    assert targets[0].tolist() == raw[49:64].tolist()
    assert inputs[1].tolist() == raw[0:15].tolist()
    # A different seq_len cuts a different number of windows out of the same stream.
    assert num_samples(tmp_path, 31) == 12 * 16 // 32
