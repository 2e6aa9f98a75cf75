"""A site's held-out sequences: a fixed split that the training sampler never deals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xffl.core.errors import InvalidInput
from xffl.training.config import DataSpec
from xffl.training.data import (
    TokenShards,
    ensure_synthetic,
    index_batches,
    site_splits,
    training_indices,
    validation_indices,
)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 3000), fraction=st.floats(0.01, 0.5), dp_size=st.integers(1, 4),
       seed=st.integers(0, 2**31), round=st.integers(0, 50))
def test_the_sampler_never_deals_a_held_out_window(n: int, fraction: float, dp_size: int,
                                                   seed: int, round: int) -> None:
    held = validation_indices(n, fraction)
    train = training_indices(n, fraction)
    # ceil(f n) held out, at least one, and at least one left to train on
    assert len(held) == min(n - 1, max(1, math.ceil(round_f(fraction * n))))
    assert len(np.intersect1d(held, train)) == 0 and len(held) + len(train) == n
    if len(train) < dp_size:
        return
    # every batch of every rank over three epochs, mapped to windows as TokenShards does
    dealt: set[int] = set()
    per_epoch = len(train) // dp_size
    for dp_rank in range(dp_size):
        batches = index_batches(len(train), 4, dp_rank, dp_size, seed, round)
        for _ in range(math.ceil(3 * per_epoch / 4)):
            dealt.update(int(w) for w in train[next(batches)])
    assert not dealt & set(held.tolist())
    assert dealt <= set(train.tolist())
    if per_epoch * dp_size == len(train):  # a whole epoch deals every training window
        assert dealt == set(train.tolist())


def round_f(x: float) -> float:
    """fraction x n as the split counts it (0.1 x 770 is 77.00000000000001 in floats)."""
    return round(x, 9)


def test_the_split_is_the_same_whatever_the_seed_round_or_process() -> None:
    a = validation_indices(768, 0.1)
    assert np.array_equal(a, validation_indices(768, 0.1))
    assert len(a) == 77 and np.all(np.diff(a) > 0)
    assert not np.array_equal(a, np.arange(77))  # spread over the corpus, not its head
    # a different corpus size draws another permutation
    assert not np.array_equal(validation_indices(769, 0.1)[:10], a[:10])


def test_a_fraction_that_leaves_nothing_to_train_is_refused() -> None:
    with pytest.raises(InvalidInput, match="nothing to train on"):
        validation_indices(1, 0.5)


def test_site_splits_read_the_held_out_sequences(tmp_path: Path) -> None:
    data = ensure_synthetic(tmp_path / "alpha", "alpha", 100, 16)
    spec = DataSpec(path=str(data), validation={"fraction": 0.25})
    train, held = site_splits(data, spec, 16)
    assert held is not None and (len(train), len(held)) == (75, 25)
    whole = TokenShards(data, 16)
    # the held-out batch is the whole corpus's windows at the held-out positions
    inputs, targets = held.batch(np.arange(25))
    expected_in, expected_tg = whole.batch(validation_indices(100, 0.25))
    assert inputs.equal(expected_in) and targets.equal(expected_tg)
    assert not set(train.window(np.arange(75)).tolist()) & set(held.window(np.arange(25)).tolist())
    # a directory of its own: the training data stays whole
    other = ensure_synthetic(tmp_path / "held", "beta", 10, 16)
    train, held = site_splits(data, DataSpec(path=str(data), validation={"path": str(other)}),
                              16)
    assert held is not None and (len(train), len(held)) == (100, 10)
    assert held.batch(np.arange(10))[0].equal(TokenShards(other, 16).batch(np.arange(10))[0])
    assert site_splits(data, DataSpec(path=str(data)), 16)[1] is None
