"""Rendezvous address from SLURM's own view of the node, on the real test cluster."""

from __future__ import annotations

import os

import pytest

from xffl.training.distributed import detect_env, node_addr


@pytest.fixture
def alpha_conf(slurm_stack, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """SLURM_CONF of the test cluster 'alpha' for the client commands."""
    cluster = slurm_stack.clusters["alpha"]
    monkeypatch.setenv("SLURM_CONF", cluster.slurm_conf)
    return cluster


def test_node_addr_comes_from_slurm(alpha_conf) -> None:  # type: ignore[no-untyped-def]
    # the node name does not resolve; SLURM knows it lives at 127.0.0.1
    assert alpha_conf.node == "alpha-n1"
    assert node_addr(alpha_conf.node) == "127.0.0.1"
    assert node_addr("no-such-node") == "no-such-node"


def test_srun_step_env_gives_resolvable_master(alpha_conf) -> None:  # type: ignore[no-untyped-def]
    env = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": alpha_conf.node, "SLURM_JOB_ID": "1234",
           "SLURM_TASKS_PER_NODE": "2", "PATH": os.environ["PATH"],
           "SLURM_CONF": alpha_conf.slurm_conf}
    dist = detect_env(env)
    assert (dist.rank, dist.world_size, dist.local_rank) == (1, 2, 1)
    assert dist.master_addr == "127.0.0.1"
    assert dist.master_port == 20000 + 1234
