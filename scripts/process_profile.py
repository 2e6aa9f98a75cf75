"""Where a command's Python CPU-seconds go: every Python process of this venv, by what it ran.

Usage: ``.venv/bin/python scripts/process_profile.py [--top N] -- COMMAND...``
(``-- bash scripts/test.sh``, or one test file:
``-- .venv/bin/python -m pytest -p no:xdist -q tests/workflows/test_one_plan.py``).

For the command's duration a ``.pth`` line in this venv's site-packages makes every
interpreter of the venv (the test workers, the runs' supervisors, StreamFlow's steps, the
launchers and ranks in the SLURM jobs of the test stack, reached over ssh) append its own
CPU-seconds (``os.times``, children excluded), argv and current test to a log when it exits;
the line is removed at the end, whatever happens. ``os._exit`` is wrapped too, so forked
ranks and fork servers leave their line (as ``fork of <what the parent ran>``, their CPU
counted from the fork); a process killed by a signal leaves none: ``scripts/test_cost.py``
counts every process's CPU, this says which command spends it. The table groups by what ran
(the module or script, the step name of ``xffl.workflows.steps``, a ``-c`` code's first
line) and by test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HOOK = """import atexit, json, os, sys
_xffl_profile_pid, _xffl_profile_exit, _xffl_profile_done = os.getpid(), os._exit, set()
def _xffl_profile_dump(log={log!r}):
    if os.getpid() in _xffl_profile_done:  # a fork may run the atexit handlers, then os._exit
        return
    _xffl_profile_done.add(os.getpid())
    try:
        t = os.times()
        argv = sys.argv[:4]
        if argv[:1] == ["-c"]:  # the code's first line says what ran (multiprocessing's -c)
            code = sys.orig_argv[sys.orig_argv.index("-c") + 1]
            argv = ["-c " + code.strip().splitlines()[0][:60]] + argv[1:]
        if os.getpid() != _xffl_profile_pid:  # a fork (its CPU counts from the fork)
            argv = ["fork of " + (argv[0] if argv else "?")] + argv[1:]
        line = json.dumps({{"cpu": t.user + t.system, "argv": argv,
                           "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                           "job": os.environ.get("SLURM_JOB_NAME", "")}})
        with open(log, "a") as f:
            f.write(line + "\\n")
    except Exception:
        pass
def _xffl_profile_os_exit(code):
    _xffl_profile_dump()
    _xffl_profile_exit(code)
atexit.register(_xffl_profile_dump)
os._exit = _xffl_profile_os_exit  # forked ranks and servers end with os._exit, past atexit
"""


def kind(argv: list[str]) -> str:
    """What a process ran: the module or script (a step's name too), from its argv."""
    first = argv[0] if argv else "?"
    for marker in ("/site-packages/", "/xffl/", str(Path(__file__).resolve().parent.parent) + "/"):
        if marker in first:
            first = first.split(marker, 1)[1]
    first = first.removesuffix("/__main__.py")
    if first.startswith("workflows/steps") and len(argv) > 1 and not argv[1].startswith("-"):
        first += f" {argv[1]}"
    return first


def main(argv: list[str]) -> int:
    """Run the command with the hook in place; print the CPU-seconds by kind and by test."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    site = Path(sysconfig.get_paths()["purelib"])
    log = Path(tempfile.mkdtemp(prefix="xffl-profile-")) / "processes.jsonl"
    module, pth = site / "_xffl_process_profile.py", site / "zz_xffl_process_profile.pth"
    module.write_text(HOOK.format(log=str(log)))
    pth.write_text("import _xffl_process_profile\n")
    try:
        rc = subprocess.call(command)
    finally:
        pth.unlink(missing_ok=True)
        module.unlink(missing_ok=True)
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by_kind: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    by_test: collections.Counter[str] = collections.Counter()
    for row in rows:
        k = kind(row["argv"])
        by_kind[k] += row["cpu"]
        count[k] += 1
        test = re.sub(r" \((setup|call|teardown)\)$", "", row["test"]) or "(no test: the " \
            "workers, or a process started over ssh or by SLURM)"
        by_test[test] += row["cpu"]
    print(f"process_profile: {len(rows)} Python processes, {sum(by_kind.values()):.1f} "
          f"CPU-s (log: {log})", file=sys.stderr)
    for k, cpu in by_kind.most_common(args.top):
        print(f"{cpu:9.1f} s  {count[k]:5d} x {cpu / count[k]:6.2f}  {k}", file=sys.stderr)
    print("by test:", file=sys.stderr)
    for test, cpu in by_test.most_common(args.top):
        print(f"{cpu:9.1f} s  {test}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main(sys.argv[1:]))
