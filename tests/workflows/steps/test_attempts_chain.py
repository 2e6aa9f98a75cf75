"""A job that ended a chained round to continue it (training.checkpoint.chain): the failure
manager reads its rank 0's line (bounded numbers of this round only), counts it as continued
(no failure, no retry), and the round's ETA follows from the steps left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xffl.core.layout import RunLayout
from xffl.jobs.registry.attempts import SiteAttempts, eta_seconds, read_attempts, write_attempts
from xffl.training.chain_files import CONTINUE_LINE
from xffl.training.round_state import PROGRESS_LINE
from xffl.workflows.steps.attempts import FREE_RETRIES, continues, counts_against_retries


def output(*lines: str) -> str:
    """A failed command as StreamFlow reports it: its name, then the command's output."""
    return "\n".join(["FAILED Job /train-beta with error:", *lines])


def ended(rnd: int, step: int, steps: int = 60, per_step: str = "0.500") -> str:
    """The job's last lines: the checkpoint of its step, then the continue line."""
    return output(PROGRESS_LINE.format(round=rnd, step=step) + " (1.0 MB, written in 0.1 s)",
                  CONTINUE_LINE.format(round=rnd, step=step, steps=steps)
                  + f" ({per_step} s/step)",
                  "xffl.training.launch: the ranks checkpointed and ended this job (exit code "
                  "75); the round continues in the next job (exit 75).")


def test_three_chained_jobs_continue_without_failures() -> None:
    record = SiteAttempts(site="beta", round=1)
    assert continues(record, ended(1, 25))
    assert (record.continued, record.best_step, record.steps) == (1, 25, 60)
    assert eta_seconds(record) == pytest.approx(35 * 0.5)
    assert continues(record, ended(1, 50, per_step="0.4"))
    assert record.continued == 2 and record.failures == []
    assert eta_seconds(record) == pytest.approx(10 * 0.4)


def test_only_this_rounds_lines_that_got_further_continue() -> None:
    record = SiteAttempts(site="beta", round=2)
    assert not continues(record, ended(1, 25))  # another round's
    assert not continues(record, output("xffl.training: round 2 continues in the next job"))
    assert not continues(record, ended(2, 60, steps=60))  # the round's end is no continue
    assert not continues(record, output("my" + CONTINUE_LINE.format(round=2, step=5,
                                                                   steps=60)[4:]))
    assert not continues(record, ended(2, 10 ** 10))  # more digits than any step has
    assert continues(record, ended(2, 30))
    assert not continues(record, ended(2, 30))  # no progress: a failure after all
    assert counts_against_retries(record, ended(2, 30))


def test_continues_are_bounded() -> None:
    record = SiteAttempts(site="beta", round=1)
    for step in range(1, FREE_RETRIES + 1):
        assert continues(record, ended(1, step, steps=10 ** 6))
    assert not continues(record, ended(1, FREE_RETRIES + 1, steps=10 ** 6))


def test_no_eta_without_a_rate() -> None:
    record = SiteAttempts(site="beta", round=1)
    assert eta_seconds(record) is None
    assert continues(record, output(CONTINUE_LINE.format(round=1, step=5, steps=9)))
    assert record.step_seconds == 0.0 and eta_seconds(record) is None


def test_the_record_keeps_the_chain(tmp_path: Path) -> None:
    """The attempts file (what status and the admit step read) keeps the continued jobs,
    the step reached, the round's steps and the rate; an older file reads as none."""
    layout = RunLayout(tmp_path)
    record = SiteAttempts(site="beta", round=1)
    assert continues(record, ended(1, 25))
    write_attempts(layout, record)
    again = read_attempts(layout, 1, "beta")
    assert again == record
    data = json.loads(layout.attempts_file(1, "beta").read_text())
    for key in ("continued", "steps", "step_seconds"):
        del data[key]
    layout.attempts_file(1, "beta").write_text(json.dumps(data))
    older = read_attempts(layout, 1, "beta")
    assert older is not None and older.continued == 0 and eta_seconds(older) is None
