"""Process-group set-up from torchrun or a scheduler's variables, with a single-process fallback.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
A scheduler's job step says the same in its own variables (SLURM's: SLURM_PROCID, ...), read
by the scheduler (:meth:`xffl.schedulers.base.Scheduler.ranks`); a batch script itself (a
job's variables but no job step) counts as a single process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from xffl.schedulers.registry import current, step_ranks
from xffl.schedulers.slurm import first_host as first_host  # re-exported: SLURM's node lists
from xffl.schedulers.slurm import node_addr as node_addr

DEFAULT_TIMEOUT_S = 1800.0
TIMEOUT_ENV = "XFFL_DIST_TIMEOUT"


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job: ranks, rendezvous address and launcher."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "none"  # "torchrun", a scheduler's name ("slurm"), or "none"

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def job_end_time(environ: Mapping[str, str] | None = None) -> float | None:
    """When this process's batch job runs out of time (epoch seconds); None outside a job."""
    env = os.environ if environ is None else environ
    scheduler = current(env)
    return None if scheduler is None else scheduler.end_time(env)


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables (torchrun first, then an srun step); world 1 otherwise."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="torchrun",
        )
    found = step_ranks(env)
    if found is not None:
        scheduler, r = found
        return DistEnv(rank=r.rank, world_size=r.world_size, local_rank=r.local_rank,
                       local_world_size=r.local_world_size, master_addr=r.master_addr,
                       master_port=r.master_port, source=scheduler.name)
    return DistEnv()


def default_timeout() -> float:
    """Collective timeout in seconds: $XFFL_DIST_TIMEOUT, else 30 minutes."""
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else DEFAULT_TIMEOUT_S


def device_for(env: DistEnv) -> torch.device:
    """The device this rank computes on: its local GPU when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(timeout_s: float | None = None, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Initialise the default process group (NCCL on GPUs, else gloo) when world > 1."""
    env = detect_env(environ)
    if env.world_size <= 1 or dist.is_initialized():
        return env
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else default_timeout())
    if torch.cuda.is_available():
        device = device_for(env)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    return env


def is_distributed() -> bool:
    """True when a process group with more than one rank is active."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """Global rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if is_distributed():
        dist.barrier()


def broadcast_str(value: str | None, src: int = 0) -> str | None:
    """Send a string (or None) from ``src`` to every rank; identity in a single process."""
    if not is_distributed():
        return value
    box: list[str | None] = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` is true on every rank (a barrier that carries a verdict)."""
    if not is_distributed():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.SUM)
    return int(flag.item()) == 0


def teardown() -> None:
    """Destroy the process group if one was created (safe to call more than once)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
