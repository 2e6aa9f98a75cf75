"""Rank and rendezvous detection from torchrun and SLURM variables."""

from __future__ import annotations

import pytest

from xffl.training import distributed as xdist
from xffl.training.distributed import DistEnv, detect_env, first_host


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("lrdn0123", "lrdn0123"),
        ("lrdn[0123-0130,0200]", "lrdn0123"),
        ("acn[07,09-12],login1", "acn07"),
        ("a1,b[1-3]", "a1"),
        ("gpu[3-4]-ib", "gpu3-ib"),
        ("rack[2-3]-n[05-06]", "rack2-n05"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_no_variables_is_a_single_process() -> None:
    assert detect_env({}) == DistEnv(rank=0, world_size=1, local_rank=0, source="none")


def test_torchrun_variables() -> None:
    env = detect_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "1234",
                      "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"})  # torchrun inside srun wins
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.source) == ("n1", 1234, "torchrun")
    assert not env.is_main


SRUN_TASK = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "6",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4,2", "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "lrdn[0042-0043]",
}


def test_srun_task_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("xffl.schedulers.slurm._scontrol_first_host", lambda nodelist: None)
    env = detect_env(SRUN_TASK)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 6, 1, 2)
    assert env.master_addr == "lrdn0042"
    assert env.master_port == 20000 + 123456 % 20000
    assert env.source == "slurm"
    pinned = detect_env({**SRUN_TASK, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (pinned.master_addr, pinned.master_port) == ("head", 29400)


def test_scontrol_is_preferred_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("xffl.schedulers.slurm._scontrol_first_host",
                        lambda nodelist: "from-scontrol")
    assert detect_env(SRUN_TASK).master_addr == "from-scontrol"


def test_batch_script_outside_a_step_is_single_process() -> None:
    batch = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")}
    assert detect_env(batch).world_size == 1


def test_tasks_per_node_repetition() -> None:
    env = detect_env({**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
                      "SLURM_STEP_NUM_TASKS": "6"})
    assert env.local_world_size == 3


def test_single_process_helpers_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(var, raising=False)
    env = xdist.setup()
    assert env.world_size == 1 and not xdist.is_distributed()
    assert (xdist.rank(), xdist.world_size()) == (0, 1)
    assert xdist.broadcast_str("x") == "x" and xdist.all_ok(True) and not xdist.all_ok(False)
    xdist.barrier()
    xdist.teardown()


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(xdist.TIMEOUT_ENV, raising=False)
    assert xdist.default_timeout() == 1800.0
    monkeypatch.setenv(xdist.TIMEOUT_ENV, "90")
    assert xdist.default_timeout() == 90.0
