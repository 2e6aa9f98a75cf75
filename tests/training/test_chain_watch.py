"""The stop watch of a chained round's job (one process, no group): the launcher's request
file, a SIGUSR1 sent to the rank itself, and the trainer's own guard, the SLURM end time less
the margin (:func:`xffl.training.round_spec.chain_margin`) and the last step's seconds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xffl.training.chain import StopWatch
from xffl.training.chain_files import request_stop
from xffl.training.round_spec import chain_margin, checkpoint_seconds


@pytest.fixture
def watch_at(tmp_path: Path) -> Iterator[list[StopWatch]]:
    """Watches made by the test, closed after it (USR1 back to its default)."""
    made: list[StopWatch] = []
    yield made
    for watch in made:
        watch.close()


def make(tmp_path: Path, made: list[StopWatch], end: float | None,
         parameters: int = 0) -> StopWatch:
    watch = StopWatch(tmp_path, 1, "ab" * 32, 60, 0, end, parameters)
    made.append(watch)
    return watch


def test_the_slurm_end_less_the_margin_stops_the_job(tmp_path: Path,
                                                     watch_at: list[StopWatch]) -> None:
    """A tiny model's margin is 2 x 1 s + 60 s = 62 s: an end
    time 30 s away is inside it, one 10 minutes away is not; a measured save of 100 s widens
    the margin to 2 x 100 + 60 = 260 s, so 4 minutes away stops too."""
    margin = chain_margin(checkpoint_seconds(0))
    assert margin == 62
    assert make(tmp_path, watch_at, time.time() + 30).should_stop(1, 0.0)
    far = make(tmp_path, watch_at, time.time() + 600)
    assert not far.should_stop(1, 0.0)
    assert not make(tmp_path, watch_at, time.time() + 240).should_stop(1, 0.0)
    assert make(tmp_path, watch_at, time.time() + 240).should_stop(1, 100.0)
    assert not make(tmp_path, watch_at, None).should_stop(1, 0.0)  # outside SLURM


def test_the_launchers_request_and_a_signal_stop_the_job(tmp_path: Path,
                                                         watch_at: list[StopWatch]) -> None:
    watch = make(tmp_path, watch_at, None)
    assert not watch.should_stop(1, 0.0)
    request_stop(tmp_path)  # the launcher's USR1
    assert watch.should_stop(2, 0.0)
    (tmp_path / ".chain-stop").unlink()
    watch = make(tmp_path, watch_at, None)
    os.kill(os.getpid(), signal.SIGUSR1)  # to the rank itself: its handler, not death
    assert watch.should_stop(3, 0.0)
