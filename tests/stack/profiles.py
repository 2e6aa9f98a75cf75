"""Site profiles that reach the test clusters through their own SSH ports."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from tests.stack.stack import ClusterInfo, StackInfo
from tests.workflows.warm_ranks import rank_python


def profile_env(warm: bool = True) -> dict[str, str]:
    """The ``env`` of a test cluster's profile: one thread a rank; ``warm``: the ranks are
    forks of this test process's warm rank server (see :func:`write_profile`)."""
    env = {"OMP_NUM_THREADS": "1"}
    if warm:
        env["XFFL_RANK_PYTHON"] = str(rank_python())
    return env


def write_profile(folder: Path, cluster: ClusterInfo, stack: StackInfo,
                  setup: Sequence[str] = (), warm: bool = True) -> str:
    """Write ``folder/test-<cluster>.yaml`` (ssh + slurm, srun launcher); return its name.

    ``warm``: the ranks srun starts in the cluster's jobs are forks of this test process's
    warm rank server (tests/workflows/warm_ranks.py: the batch script exports
    ``XFFL_RANK_PYTHON``, the ranks' interpreter, as the profile's ``env``), which imported
    torch, transformers and the trainer once, instead of importing them in every rank (~3
    CPU-s each). SLURM, sshd, StreamFlow, the batch script, srun, the launcher and the rank's
    code are the same; a signal SLURM sends a rank reaches it through its client, and a rank
    whose client SLURM killed dies with it. ``warm=False`` where how the rank's interpreter
    starts is under test (an installed venv, exec'd ranks end to end).
    """
    name = f"test-{cluster.name}"
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name,
        "description": f"test cluster {cluster.name} through its own SSH port",
        "connector": {"type": "ssh", "host": "127.0.0.1", "port": cluster.ssh_port,
                      "user": stack.user, "key_file": stack.ssh_key,
                      "known_hosts": stack.known_hosts},
        "slurm": {"partition": cluster.partition, "time": "00:10:00", "polling_interval": 1},
        "launcher": "srun",
        "python": sys.executable,
        "workdir": cluster.work_dir,
        "setup": list(setup),
        "env": profile_env(warm),
    }))
    return name
