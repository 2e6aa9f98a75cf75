"""Threads per training rank: the launcher shares the CPUs among the ranks that use them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.core.resources import usable_cpus
from xffl.training.launch import launch
from xffl.training.threads import LOCAL_RANKS_ENV, rank_threads, ranks_per_node


def test_an_explicit_setting_wins() -> None:
    env = {"OMP_NUM_THREADS": "3", "SLURM_CPUS_PER_TASK": "8", LOCAL_RANKS_ENV: "2"}
    assert rank_threads(env, ranks_here=1, cpus=16) is None  # torch reads OMP_NUM_THREADS


def test_slurm_allocation_then_the_shared_cpus() -> None:
    assert rank_threads({"SLURM_CPUS_PER_TASK": "8"}, ranks_here=4, cpus=64) == 8
    assert rank_threads({}, ranks_here=4, cpus=16) == 4
    assert rank_threads({}, ranks_here=1, cpus=16) == 16
    assert rank_threads({LOCAL_RANKS_ENV: "6"}, ranks_here=2, cpus=16) == 2  # 3 local sites
    assert rank_threads({}, ranks_here=4, cpus=2) == 1  # never below one
    # a value that is no positive number is ignored, not an error
    assert rank_threads({"SLURM_CPUS_PER_TASK": "x", LOCAL_RANKS_ENV: "0"}, 2, 8) == 4


def test_ranks_per_node() -> None:
    assert ranks_per_node(4, {"SLURM_JOB_NUM_NODES": "2"}, "torchrun") == 4
    assert ranks_per_node(4, {"SLURM_JOB_NUM_NODES": "2"}, "srun") == 2
    assert ranks_per_node(5, {"SLURM_NNODES": "2"}, "srun") == 3
    assert ranks_per_node(4, {}, "srun") == 4


ENV_TRAINER = """
import json, os, sys
with open(sys.argv[1], "w") as fh:
    json.dump(os.environ.get("OMP_NUM_THREADS"), fh)
"""


@pytest.mark.parametrize(("env", "ranks", "expected"), [
    ({}, 1, max(1, usable_cpus())),
    ({LOCAL_RANKS_ENV: "4"}, 1, max(1, usable_cpus() // 4)),
    ({"OMP_NUM_THREADS": "5"}, 1, 5),
])
def test_the_launcher_sets_what_its_ranks_see(tmp_path: Path, env: dict[str, str], ranks: int,
                                               expected: int) -> None:
    (tmp_path / "env_trainer.py").write_text(ENV_TRAINER)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", LOCAL_RANKS_ENV)}
    seen = tmp_path / "seen.json"
    launch(ranks, "none", [str(seen)], tmp_path / "out", module="env_trainer",
           env={**base, "PYTHONPATH": str(tmp_path), **env})
    assert json.loads(seen.read_text()) == str(expected)


@pytest.mark.slow
def test_a_real_rank_trains_with_its_share(tmp_path: Path, global0: tuple[Path, Manifest],
                                           make_job) -> None:  # type: ignore[no-untyped-def]
    """Two local sites of one rank each: each rank gets half the CPUs (torch's default is all
    of them, and two such ranks spin against each other)."""
    job_file = tmp_path / "job.json"
    job_file.write_text(make_job(tmp_path / "data", sequences=8, steps=1).model_dump_json())
    out = tmp_path / "update"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    args = ["--job", str(job_file), "--round", "1", "--model", str(global0[0]), "--out",
            str(out)]
    assert launch(1, "none", args, out, env={**env, LOCAL_RANKS_ENV: "2"}) == 0
    assert verify_checkpoint(out).extra["threads"] == max(1, usable_cpus() // 2)
