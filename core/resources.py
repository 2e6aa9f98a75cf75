"""The process's own resource use, for the registry and the benchmarks."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which SLURM and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
