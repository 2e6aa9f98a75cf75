"""The early-stop rule against Keras's EarlyStopping, written out from Keras's documentation.

``keras.callbacks.EarlyStopping(monitor="val_loss", mode="min", min_delta=d, patience=p)``:
at the end of every epoch the wait counter goes up by one; a value lower than the best so
far by more than ``d`` ("an absolute change of less than min_delta will count as no
improvement") becomes the best and sets the wait back to 0; otherwise, once the wait
reaches ``p`` ("number of epochs with no improvement after which training will be
stopped"), training stops. Here an epoch is a round that recorded a federated validation
loss, and the run stops after the first round where the rule says so.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xffl.jobs.registry.states import SiteState
from xffl.workflows.steps.early_stop import federated, stop_reason
from xffl.workflows.steps.verdict import Verdict


class KerasEarlyStopping:
    """Keras's EarlyStopping in mode "min" (its on_epoch_end and _is_improvement)."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best, self.best_epoch, self.wait = math.inf, -1, 0
        self.stopped = False

    def on_epoch_end(self, epoch: int, value: float) -> None:
        """One epoch's value: improvement resets the wait, else the wait may stop training."""
        self.wait += 1
        if value + self.min_delta < self.best:  # Keras: monitor_op(value - (-min_delta), best)
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped = True


def first_stops(values: list[float], patience: int, min_delta: float) -> tuple[int | None,
                                                                             int | None]:
    """(the round after which xffl stops, the round after which Keras stops), rounds from 1;
    checks xffl's reason (wait, best, its round) against Keras's state where both stop."""
    keras = KerasEarlyStopping(patience, min_delta)
    ours: int | None = None
    theirs: int | None = None
    for epoch, value in enumerate(values):
        rnd = epoch + 1
        reason = stop_reason(list(enumerate(values[:rnd], start=1)), patience, min_delta)
        keras.on_epoch_end(epoch, value)
        if reason is not None and ours is None:
            ours = rnd
        if keras.stopped and theirs is None:
            theirs = rnd
            assert reason is not None, (values, rnd)
            assert f"in {keras.wait} round(s)" in reason, reason
            assert f"best {keras.best:.4f}, of the global model round {keras.best_epoch + 1}" \
                in reason, reason
        if ours is not None or theirs is not None:
            break
    return ours, theirs


# (values, patience, min_delta, the round after which training stops, or None)
SEQUENCES = {
    "improving": ([4.0, 3.0, 2.0, 1.0, 0.5], 1, 0.0, None),
    "plateau": ([4.0, 3.0, 3.0, 3.0, 3.0], 2, 0.0, 4),  # rounds 3 and 4 do not improve
    "plateau, patience 1": ([4.0, 4.0, 3.0], 1, 0.0, 2),
    "worse then better": ([4.0, 5.0, 3.0, 5.0, 5.0], 2, 0.0, 5),
    # min_delta 0.25: 3.75 is exactly min_delta below 4 (no improvement, as Keras's
    # "change of less than min_delta" and its strict comparison say); 3.7421875 is more
    # (every number here is exact in binary, so neither side rounds)
    "min_delta edge": ([4.0, 3.75, 3.75], 2, 0.25, 3),
    "just over min_delta": ([4.0, 3.7421875, 3.5], 2, 0.25, None),
    # steps of 0.125 each under min_delta 0.25, but round 4 is 0.375 below the best (round
    # 1's): compared with the best, not with the round before
    "small steps add up": ([4.0, 3.875, 3.75, 3.625], 3, 0.25, None),
    # the wait goes back to 0 after an improvement: two non-improving rounds, a better one,
    # then one more non-improving round is a wait of 1, not 3
    "reset after improvement": ([4.0, 4.5, 4.5, 3.0, 3.5], 3, 0.0, None),
    "reset, then the full patience": ([4.0, 4.5, 3.0, 3.5, 3.5], 2, 0.0, 5),
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_hand_made_sequences(name: str) -> None:
    values, patience, min_delta, stop = SEQUENCES[name]
    assert first_stops(values, patience, min_delta) == (stop, stop)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.integers(0, 16).map(lambda k: k / 8), min_size=1, max_size=12),
       patience=st.integers(1, 4), min_delta=st.sampled_from([0.0, 0.125, 0.25, 0.5]))
def test_same_as_keras(values: list[float], patience: int, min_delta: float) -> None:
    """Any series (eighths: exact in binary, ties with min_delta included) stops where
    Keras's EarlyStopping stops, with its wait and best."""
    ours, theirs = first_stops(values, patience, min_delta)
    assert ours == theirs, (values, patience, min_delta)


def _measured(site: str, loss: float, samples: int, tokens: int,
              state: SiteState = SiteState.COMPLETED) -> Verdict:
    return Verdict(site=site, round=2, state=state, val_loss=loss, val_loss_update=loss,
                   val_samples=samples, val_tokens=tokens)


def test_the_federated_validation_loss_is_the_mean_over_every_sites_targets() -> None:
    """A site's val_loss is its mean over its held-out targets in the loss: the federated
    loss is the mean over all the sites' targets, i.e. the sum of each site's loss sum
    (val_loss x val_tokens) over the sum of the counts. A rejected site, and a site whose
    held-out sequences hold no target in the loss (its loss of nothing is 0), weigh nothing.
    For text data (every sequence has seq_len targets) that is the sequence-weighted mean."""
    # masked data: alpha's 10 sequences hold 30 response tokens, beta's 30 hold 270
    sums = {"alpha": 30 * 2.0, "beta": 270 * 1.0}  # each site's sum of token losses
    verdicts = [_measured("alpha", sums["alpha"] / 30, 10, 30),
                _measured("beta", sums["beta"] / 270, 30, 270),
                _measured("gamma", 0.0, 4, 0),  # prompts only among its held-out sequences
                _measured("liar", 0.01, 40, 10**6, SiteState.REJECTED)]
    got = federated(2, verdicts)
    assert got is not None
    assert got.val_loss == (60.0 + 270.0) / 300  # not (10 x 2 + 30 x 1) / 40 = 1.25
    assert (got.val_samples, got.val_tokens) == (40, 300)
    assert got.sites == {"alpha": 2.0, "beta": 1.0}
    assert got.site_tokens == {"alpha": 30, "beta": 270}
    assert federated(2, verdicts[2:]) is None  # no target in the loss anywhere: no number

    # text data, seq_len 64: the same float as weighting by sequences (x 64 is exact)
    text = [_measured("alpha", 5.25, 77, 77 * 64), _measured("beta", 5.5, 52, 52 * 64)]
    got = federated(2, text)
    assert got is not None
    assert got.val_loss == math.fsum((5.25 * 77, 5.5 * 52)) / (77 + 52)
