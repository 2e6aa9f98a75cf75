"""Under throughput balancing a site's count is bounded by its round's job, not the plan's most.

The attack: with ``training.balance: throughput`` (or a round deadline) the plan passes each
admit step the most samples any round may give the site, ``balance_max`` (4) x its configured
steps. HEAD admitted that much every round, so a site whose job allowed 480 samples could
claim 1920 and outweigh an honest site 4 to 1. Here the admit step (the real one, with the
bounds the plan passes it) judges updates of a rendered plan's run directory, whose round 2
job file is the one throughput balancing writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.aggregator.conftest import write_checkpoint
from tests.conftest import QUICKSTART
from xffl.aggregator.exchange import read_manifest
from xffl.aggregator.reported import Bounds
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.jobs.spec.schema import JobSpec
from xffl.workflows.steps.admit import SIDE_FILES, admit
from xffl.workflows.steps.balance import configured_job, write_round_job
from xffl.workflows.steps.bounds import report_bounds

runner = CliRunner()
CONFIG = {"hidden_size": 8}
STEPS, BATCH, RANKS = 30, 8, 2  # a round's samples: steps x batch x 1 accumulation x ranks
SEQ = 64  # the quickstart's seq_len: a round's tokens are its samples x this


def _plan(tmp_path: Path, how: str) -> RunLayout:
    """The quickstart's plan with throughput balancing (or a round deadline), sites on real
    data of no declared size (so a site's samples are bounded by its round's steps alone)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["training"].update(steps=STEPS, batch_size=BATCH, balance_max=4.0)
    if how == "throughput":
        spec["training"]["balance"] = "throughput"
    else:  # the deadline's most steps default to balance_max x the configured ones
        spec["round_deadline"] = {"seconds": 600}
    for site in spec["sites"]:
        site.update(ranks=RANKS, data={"path": f"data/{site['name']}"})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = runner.invoke(app, ["render", str(job), "-o", str(tmp_path / "run"),
                                 "--no-init-model"])
    assert result.exit_code == 0, result.output
    return RunLayout(tmp_path / "run")


def _update(tmp_path: Path, glob: Path, rnd: int, samples: int, tokens: int) -> Path:
    return write_checkpoint(tmp_path / "updates" / f"{rnd}-{samples}-{tokens}",
                            {"w": torch.ones(4)}, site="alpha", round=rnd,
                            parent=read_manifest(glob).digest(),
                            run_id=read_manifest(glob).run_id, num_samples=samples,
                            num_tokens=tokens, config=CONFIG)


@pytest.mark.parametrize(("how", "balanced"), [("throughput", 2 * STEPS),
                                               ("throughput", STEPS + 7), ("deadline", 3)])
def test_a_balanced_round_bounds_the_count_by_its_own_steps(tmp_path: Path, how: str,
                                                            balanced: int) -> None:
    """Round 1 runs the configured 30 steps (480 samples), round 2 the ``balanced`` steps
    balancing (or the deadline) gave alpha: each round admits exactly its own job's samples
    and rejects one more, although the plan's bound is 4 x 480 = 1920 (what HEAD admitted
    in both)."""
    layout = _plan(tmp_path, how)
    spec = JobSpec.of_run(layout.root)
    alpha = spec.sites[0]
    tokens, samples, held_out, seq_len = report_bounds(spec, alpha)
    assert samples == 4 * STEPS * BATCH * RANKS  # the plan's most: balance_max x a round's
    plan = Bounds(max_tokens=tokens, max_samples=samples, side_files=SIDE_FILES,
                  max_val_samples=held_out, val_seq_len=seq_len)
    # the job file balancing (balance.round_job) or the deadline (deadline.deadline_jobs)
    # writes for round 2
    write_round_job(layout.root, "alpha", 2, configured_job(layout.root, "alpha"), balanced)
    glob = write_checkpoint(tmp_path / "global", {"w": torch.zeros(4)}, kind="global",
                            site=None, round=0, config=CONFIG)
    for rnd, steps in ((1, STEPS), (2, balanced)):
        allowed = steps * BATCH * RANKS
        verdict, manifest = admit(layout, "alpha", rnd, glob,
                                  _update(tmp_path, glob, rnd, allowed, allowed * SEQ), plan)
        assert verdict.state == SiteState.COMPLETED and manifest is not None, verdict.reason
        assert (verdict.num_samples, verdict.num_tokens) == (allowed, allowed * SEQ)
        for claim, what in ((allowed + 1, "num_samples"), (samples, "num_samples"),
                            (allowed * SEQ + 1, "num_tokens")):
            sent = (claim, allowed * SEQ) if what == "num_samples" else (allowed, claim)
            verdict, manifest = admit(layout, "alpha", rnd, glob,
                                      _update(tmp_path, glob, rnd, *sent), plan)
            assert (verdict.state, manifest) == (SiteState.REJECTED, None), (rnd, claim)
            most = allowed if what == "num_samples" else allowed * SEQ
            assert verdict.reason == (f"{what} is {claim}, more than the {most} the site's "
                                      "job allows"), verdict.reason
