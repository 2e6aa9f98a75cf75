"""SLURM, the one scheduler xffl drives today: its rank variables, time limit and job record.

Under ``srun`` each task sees SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS),
SLURM_LOCALID and SLURM_JOB_NODELIST; the rendezvous address is the first host of the node
list and the port is derived from the job id so that concurrent jobs on a node do not collide.
A batch script itself (SLURM variables but no job step) counts as a single process.

At a job's start the launcher renames it with ``scontrol update`` when it is not yet named as
the round's job should be (``xffl-<run>-<site>-r<round>``: a script submitted by hand, or
main.cwl run directly by StreamFlow), so SLURM's own records (squeue, sacct, jobcomp) carry
the round, and records what ``scontrol show job`` says of it. The login node's dialect
(#SBATCH, squeue, scancel, ``sbatch --test-only``) is :mod:`xffl.schedulers.slurm_login`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from xffl.schedulers import slurm_login
from xffl.schedulers.base import QueuedJob, Ranks

SCONTROL_TIMEOUT = 20.0


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


def step_ranks(env: Mapping[str, str]) -> Ranks | None:
    """An srun task's rank, world and rendezvous (MASTER_ADDR/PORT win); None outside a step."""
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if "SLURM_PROCID" not in env or not in_step:
        return None
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
    return Ranks(rank=int(env["SLURM_PROCID"]), world_size=world,
                 local_rank=int(env.get("SLURM_LOCALID", "0")), local_world_size=local_world,
                 master_addr=addr, master_port=port)


def _scontrol(args: list[str]) -> str | None:
    """stdout of ``scontrol ARGS``; None when it is missing, fails or hangs."""
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show -o job`` output as KEY -> VALUE (values never hold spaces with -o)."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def _epoch(text: str | None) -> float | None:
    """SLURM's local ISO time (2026-11-22T07:00:02) as epoch seconds."""
    try:
        return datetime.fromisoformat(text).timestamp() if text else None
    except ValueError:
        return None


def job_start(name: str | None, env: Mapping[str, str]) -> dict[str, Any] | None:
    """At the job's start: rename it to ``name`` if needed; return what SLURM says about it.

    None outside a SLURM job. Never raises: a job that cannot be renamed or described still
    trains (the record then says so).
    """
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    record: dict[str, Any] = {"job_id": job_id, "job_name": env.get("SLURM_JOB_NAME", ""),
                              "cluster": env.get("SLURM_CLUSTER_NAME", ""),
                              "node_list": env.get("SLURM_JOB_NODELIST", ""),
                              "launcher_start": time.time()}
    if name and record["job_name"] != name:
        record["renamed_from"] = record["job_name"]
        if _scontrol(["update", f"JobId={job_id}", f"JobName={name}"]) is None:
            record["rename_error"] = f"scontrol update JobName={name} failed"
        else:
            record["job_name"] = name
    shown = _scontrol(["show", "-o", "job", job_id])
    fields = parse_show_job(shown) if shown else {}
    record["job_name"] = fields.get("JobName", record["job_name"])
    record["node_list"] = fields.get("NodeList", record["node_list"])
    record["partition"] = fields.get("Partition", env.get("SLURM_JOB_PARTITION", ""))
    submit, started = _epoch(fields.get("SubmitTime")), _epoch(fields.get("StartTime"))
    record["submit_time"], record["start_time"] = submit, started
    record["queue_wait_s"] = (max(0.0, started - submit)
                              if submit is not None and started is not None else None)
    return record


class Slurm:
    """SLURM behind the :class:`~xffl.schedulers.base.Scheduler` protocol."""

    name = "slurm"
    streamflow_connector = "streamflow.deployment.connector.queue_manager:SlurmConnector"
    job_word = "SLURM job"
    cancelled_word = "scancelled"

    def batch_options(self, settings: Mapping[str, object], extra: Sequence[str]) -> list[str]:
        """``--partition=...`` and the other sbatch options that are set, ``extra`` last."""
        return slurm_login.batch_options(settings, extra)

    def name_directive(self, job_name: str) -> str:
        """``#SBATCH --job-name=...``."""
        return slurm_login.name_directive(job_name)

    def directives(self, nodes: int, ranks: int, time: str, options: Sequence[str],
                   signal_margin: int | None = None) -> list[str]:
        """The ``#SBATCH`` lines of a round's job."""
        return slurm_login.directives(nodes, ranks, time, options, signal_margin)

    def list_command(self) -> str:
        """The login node's clock, then squeue of every job of the user."""
        return f"{slurm_login.CLOCK}; {slurm_login.SQUEUE_MINE}"

    def parse_list(self, text: str) -> list[QueuedJob]:
        """What :meth:`list_command` printed, as jobs."""
        return slurm_login.parse_squeue(text)

    def job_ids_command(self, prefix: str) -> str:
        """squeue's ids of the user's jobs named ``prefix`` or ``prefix-r<digits>``."""
        return slurm_login.job_ids_command(prefix)

    def cancel_command(self, prefix: str, names: Sequence[str]) -> str:
        """scancel by id under ``prefix``, then by each of ``names``."""
        return slurm_login.cancel_command(prefix, names)

    def estimate_command(self, nodes: int, ranks: int, time: str,
                         options: Sequence[str]) -> str:
        """The clock, then ``sbatch --test-only`` of a round's job."""
        return slurm_login.estimate_command(nodes, ranks, time, options)

    def parse_estimate(self, text: str) -> float | None:
        """Seconds to ``sbatch --test-only``'s estimated start."""
        return slurm_login.parse_test_only(text)

    def in_job(self, environ: Mapping[str, str]) -> bool:
        """Whether SLURM_JOB_ID is set."""
        return bool(environ.get("SLURM_JOB_ID"))

    def ranks(self, environ: Mapping[str, str]) -> Ranks | None:
        """An srun task's rank variables."""
        return step_ranks(environ)

    def end_time(self, environ: Mapping[str, str]) -> float | None:
        """SLURM_JOB_END_TIME, else squeue's end time of the job."""
        return slurm_end_time(environ)

    def job_start(self, name: str | None, environ: Mapping[str, str]) -> dict[str, Any] | None:
        """Rename the job to ``name`` if needed, and describe it (scontrol)."""
        return job_start(name, environ)


SLURM = Slurm()
