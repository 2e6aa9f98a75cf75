"""Process-group set-up from torchrun or SLURM variables, with a single-process fallback.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
Under ``srun`` each task sees SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS),
SLURM_LOCALID and SLURM_JOB_NODELIST; the rendezvous address is the first host of the node
list and the port is derived from the job id so that concurrent jobs on a node do not collide.
A batch script itself (SLURM variables but no job step) counts as a single process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

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
    source: Literal["torchrun", "slurm", "none"] = "none"

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list ("node[003-005,9],gpu1" -> "node003"), no scontrol."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty SLURM node list")
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end]
    match = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", first)
    if not match:
        return first
    prefix, ranges, suffix = match.groups()
    start = ranges.split(",")[0].split("-")[0]
    # Nested brackets in the suffix ("a[1-2]b[3-4]") are expanded recursively.
    return prefix + start + (first_host(suffix) if "[" in suffix else suffix)


def _scontrol_first_host(nodelist: str) -> str | None:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=20, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def node_addr(host: str) -> str:
    """The address SLURM reaches ``host`` at (its NodeAddr), or ``host`` itself.

    Node names need not resolve in DNS (SLURM maps them with NodeAddr), so the rendezvous
    address is taken from SLURM's own view of the node.
    """
    exe = shutil.which("scontrol")
    if exe is None:
        return host
    try:
        out = subprocess.run([exe, "show", "node", "-o", host], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return host
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else host


def slurm_end_time(environ: Mapping[str, str] | None = None) -> float | None:
    """When this SLURM job's time limit runs out (epoch seconds); None outside SLURM.

    SLURM_JOB_END_TIME where SLURM exports it (23.02 and later), else ``squeue -o %e``.
    """
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job, exe = env.get("SLURM_JOB_ID"), shutil.which("squeue")
    if not job or exe is None:
        return None
    try:
        out = subprocess.run([exe, "-h", "-j", job, "-o", "%e"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip()
        return time.mktime(time.strptime(out, "%Y-%m-%dT%H:%M:%S"))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # no time limit (UNLIMITED / N/A) or squeue unavailable


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """Entry ``node_id`` of a SLURM tasks-per-node list such as "2(x3),1"."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


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
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if "SLURM_PROCID" in env and in_step:
        world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
        node_id = int(env.get("SLURM_NODEID", "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_world = (_tasks_on_node(per_node, node_id) if per_node else None) or world
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        else:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
            addr = (
                node_addr(_scontrol_first_host(nodelist) or first_host(nodelist))
                if nodelist else "127.0.0.1"
            )
        if "MASTER_PORT" in env:
            port = int(env["MASTER_PORT"])
        else:
            port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=local_world,
            master_addr=addr,
            master_port=port,
            source="slurm",
        )
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
