"""A failed site attempt that left a newer checkpoint inside the round uses no retry."""

from __future__ import annotations

from xffl.jobs.registry.attempts import SiteAttempts
from xffl.training.round_state import PROGRESS_LINE
from xffl.workflows.steps.attempts import FREE_RETRIES, counts_against_retries, progress_step


def output(*lines: str) -> str:
    """A failed command as StreamFlow reports it: its name, then the command's output."""
    return "\n".join(["FAILED Job /train-beta with error:", *lines])


def line(rnd: int, step: int) -> str:
    """The trainer's own progress line (with what it prints after the numbers)."""
    return PROGRESS_LINE.format(round=rnd, step=step) + " (1.2 MB, written in 0.01 s)"


def test_progress_is_the_trainers_line_of_this_round_only() -> None:
    text = output("step 25/40 loss 3.1", line(1, 10), line(1, 20), line(2, 30),
                  "xffl.training.launch: training failed (signal SIGKILL)")
    assert progress_step(text, 1) == 20
    assert progress_step(text, 2) == 30
    assert progress_step(text, 3) is None
    # inside a line too (a prefix the transport adds), but not with more digits than any
    # round has, nor glued to another word
    assert progress_step(output("[beta] " + line(1, 20)), 1) == 20
    assert progress_step(output(PROGRESS_LINE.format(round=1, step=10 ** 12)), 1) is None
    assert progress_step(output("my" + line(1, 20)), 1) is None


def test_only_attempts_that_got_further_are_free() -> None:
    record = SiteAttempts(site="beta", round=1)
    assert not counts_against_retries(record, output(line(1, 10), line(1, 20)))
    assert (record.progressed, record.best_step) == (1, 20)
    # the next attempt continued from 20 and died before its next checkpoint: it counts
    assert counts_against_retries(record, output("continuing round 1 at step 20"))
    assert counts_against_retries(record, output(line(1, 20)))
    assert counts_against_retries(record, output(line(2, 30)))  # another round's
    assert not counts_against_retries(record, output(line(1, 30)))
    assert (record.progressed, record.best_step) == (2, 30)


def test_free_retries_are_bounded() -> None:
    record = SiteAttempts(site="beta", round=1)
    for step in range(1, FREE_RETRIES + 1):
        assert not counts_against_retries(record, output(line(1, step)))
    assert counts_against_retries(record, output(line(1, FREE_RETRIES + 1)))
