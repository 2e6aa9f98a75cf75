"""Site profiles that reach the test clusters through their own SSH ports."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from tests.stack.stack import ClusterInfo, StackInfo


def write_profile(folder: Path, cluster: ClusterInfo, stack: StackInfo,
                  setup: Sequence[str] = ()) -> str:
    """Write ``folder/test-<cluster>.yaml`` (ssh + slurm, srun launcher); return its name."""
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
        "env": {"OMP_NUM_THREADS": "1"},
    }))
    return name
