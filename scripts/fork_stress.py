"""Start xffl's forked launcher many times over and count the launches whose ranks hang.

Usage: ``.venv/bin/python scripts/fork_stress.py [--runs N] [--ranks R] [--timeout S]
[--launcher FILE]`` (``--launcher`` runs another copy of ``training/forked.py``, an older
one, as a script). Each launch's ranks do what a training rank does first: a gloo process
group through the agent's store (TORCHELASTIC_USE_AGENT_STORE), three all-reduces and a
barrier. A launch that is not over after ``--timeout`` seconds is a hang: with ``py-spy`` on
the PATH every process of it is dumped (``--native``) into the report, then it is killed.
Run it beside CPU hogs (``scripts/under_load.py``'s, or ``yes > /dev/null``): a rank forked
while one of the agent's threads held a libc lock hung about once in a hundred launches on a
busy 2-core machine (forked from the agent itself, before the fork server).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = """import torch, torch.distributed as dist
from xffl.training import distributed
env = distributed.setup(timeout_s=90)
t = torch.ones(1000) * env.rank
for _ in range(3):
    dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
"""


def dump(group: int) -> str:
    """py-spy's native stacks of every process in ``group`` (empty without py-spy)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return ""
    pids = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True,
                          timeout=30).stdout.split()
    return "".join(subprocess.run([spy, "dump", "--native", "--pid", pid], capture_output=True,
                                  text=True, timeout=60).stdout for pid in pids)


def main(argv: list[str]) -> int:
    """Run the launches; print each hang's stacks and the count; exit 1 if any hung."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--launcher", type=Path, help="a training/forked.py to run as a script")
    args = parser.parse_args(argv)
    where = Path(tempfile.mkdtemp(prefix="xffl-fork-stress-"))
    (where / "fork_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(where), "OMP_NUM_THREADS": "1"}
    launcher = [str(args.launcher)] if args.launcher else ["-m", "xffl.training.forked"]
    hung = failed = 0
    try:
        for i in range(args.runs):
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, *launcher, "--nproc-per-node",
                                     str(args.ranks), "-m", "fork_probe"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                hung += 1
                print(f"launch {i}: hung after {args.timeout:.0f} s\n{dump(proc.pid)}",
                      flush=True)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                continue
            failed += rc != 0
            print(f"launch {i}: exit {rc} in {time.monotonic() - start:.1f} s", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print(f"fork_stress: {args.runs} launches of {args.ranks} ranks: {hung} hung, "
          f"{failed} failed")
    return 1 if hung or failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
