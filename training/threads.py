"""How many CPU threads each training rank runs: the CPUs it may use, shared among its peers.

torch starts one intra-op thread per core in every process unless told otherwise. Two ranks
(or two sites on one machine) then run twice as many threads as there are cores, and
OpenMP's spinning workers burn the difference: two one-rank sites of the quickstart on a
2-core machine took 29 CPU-seconds for a round instead of 8. The launcher therefore sets
``OMP_NUM_THREADS`` for its ranks, in this order:

1. an ``OMP_NUM_THREADS`` already in the environment (the site profile's ``env``, the user);
2. SLURM's allocation, ``SLURM_CPUS_PER_TASK`` (``--cpus-per-task``);
3. the CPUs the launcher may run on, divided among the ranks that share them: the site's
   ranks on this node, or, for sites that share the coordinator's machine (the ``local``
   connector), the ranks of all of them (``XFFL_LOCAL_RANKS``, written by the plan).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

LOCAL_RANKS_ENV = "XFFL_LOCAL_RANKS"
OMP_ENV = "OMP_NUM_THREADS"


def _positive(value: str | None) -> int | None:
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if number >= 1 else None


def ranks_per_node(ranks: int, env: Mapping[str, str], launcher: str) -> int:
    """How many of the site's ranks run beside each other on one node."""
    if launcher != "srun":
        return ranks  # torchrun and a single process start every rank on this machine
    nodes = _positive(env.get("SLURM_JOB_NUM_NODES")) or _positive(env.get("SLURM_NNODES")) or 1
    return math.ceil(ranks / nodes)


def rank_threads(env: Mapping[str, str], ranks_here: int, cpus: int) -> int | None:
    """Threads per rank, or None where ``OMP_NUM_THREADS`` already decides (rule 1 above)."""
    if env.get(OMP_ENV, "").strip():
        return None
    allocated = _positive(env.get("SLURM_CPUS_PER_TASK"))
    if allocated is not None:
        return allocated
    sharing = _positive(env.get(LOCAL_RANKS_ENV)) or max(1, ranks_here)
    return max(1, cpus // sharing)
