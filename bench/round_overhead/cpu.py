"""The coordinator's CPU seconds per round: the supervisor's own and its step processes'.

Wall time on a shared machine says how long the cores were busy with others; CPU time says
what the run itself cost. A thread samples ``/proc`` every ``PERIOD`` seconds while the run
goes: the supervisor (the process whose working directory is the run's directory and whose
command line is ``-m xffl.workflows.supervisor``; it runs StreamFlow) and its children.
``/proc/<pid>/stat`` gives a process's own user+system time and, separately, that of its
children it has waited for, so the supervisor's samples split each round exactly into
``self`` (StreamFlow: scheduling, SSH, transfers, polling) and ``steps`` (the coordinator's
step processes it ran: admit, aggregate; with the warm step server
(:mod:`xffl.workflows.steps.warm`), the clients it ran and the server's own time and its
forks', which the server reaps as they end). Each child's last sample, by its module, says
roughly where ``steps`` went (StreamFlow runs a step as ``sh -c``: the step's Python is
a grandchild) (a child's last ``PERIOD`` before it exits is not seen, so the
named parts add up to a little less than ``steps``).

    sampler = CpuSampler(run_dir); sampler.start(); ...; sampler.stop()
    sampler.per_round([(start, end), ...])
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PERIOD = 0.05
TICK = os.sysconf("SC_CLK_TCK")
MODULE = "xffl.workflows.supervisor"


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (None: gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (its children, theirs, ...), as they are now."""
    out, todo = [], [pid]
    while todo:
        try:
            kids = [int(kid) for task in Path(f"/proc/{todo.pop()}/task").glob("*/children")
                    for kid in task.read_text().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def _kind(argv: list[str]) -> str:
    """A child's name in the breakdown: the step module's last part (``python -m
    xffl.workflows.steps STEP``: the step's), else the program's."""
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        at = argv.index("-m") + 1
        if argv[at] == "xffl.workflows.steps" and at + 1 < len(argv):
            return f"{argv[at + 1]}*"  # the client handing the step to the warm server
        return argv[at].rsplit(".", 1)[-1]
    return Path(argv[0]).name if argv and argv[0] else "?"


class CpuSampler(threading.Thread):
    """Samples the run's supervisor and its children until :meth:`stop`."""

    def __init__(self, run_parent: Path) -> None:
        super().__init__(daemon=True)
        self.parent = run_parent.resolve()
        self.pid: int | None = None
        self.series: list[tuple[float, float, float]] = []  # (time, self s, children s)
        self.children: dict[int, tuple[str, float, float]] = {}  # pid: (kind, first t, cpu s)
        self._halt = threading.Event()

    def _find(self) -> int | None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or MODULE not in _cmdline(int(entry.name)):
                continue
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:
                continue
            if cwd.is_relative_to(self.parent):
                return int(entry.name)
        return None

    def _sample(self, pid: int) -> bool:
        fields = _stat(pid)
        if fields is None:
            return False
        now = time.time()
        # fields[11:15]: utime, stime, cutime, cstime (proc(5) fields 14-17), in ticks
        utime, stime, cutime, cstime = (int(x) / TICK for x in fields[11:15])
        warm = 0.0
        for kid in _descendants(pid):
            f = _stat(kid)
            if f is None:
                continue
            kind, first, _ = self.children.get(kid, (_kind(_cmdline(kid)), now, 0.0))
            self.children[kid] = (kind, first, (int(f[11]) + int(f[12])) / TICK)
            if kind == "warm" and int(f[1]) == pid:  # the server: its own and its forks'
                warm += sum(int(x) for x in f[11:15]) / TICK
        self.series.append((now, utime + stime, cutime + cstime + warm))
        return True

    def run(self) -> None:
        while not self._halt.is_set():
            if self.pid is None:
                self.pid = self._find()
            elif not self._sample(self.pid):
                return
            self._halt.wait(PERIOD)

    def stop(self) -> None:
        """End the sampling (the supervisor may be gone already)."""
        self._halt.set()
        self.join()

    def _at(self, t: float) -> tuple[float, float]:
        """The supervisor's (self, children) CPU seconds at the last sample before ``t``."""
        before = [(s, c) for when, s, c in self.series if when <= t]
        return before[-1] if before else (0.0, 0.0)

    def per_round(self, windows: list[tuple[float, float]]) -> list[dict[str, float]]:
        """Each (start, end) window's CPU seconds: self, steps, and the children by kind."""
        rows = []
        for start, end in windows:
            s0, c0 = self._at(start)
            s1, c1 = self._at(end)
            row = {"self": s1 - s0, "steps": c1 - c0}
            for kind, first, cpu in self.children.values():
                if start <= first < end:
                    row[kind] = row.get(kind, 0.0) + cpu
            rows.append(row)
        return rows


def show(rows: list[dict[str, float]]) -> None:
    """One line per round: the coordinator's CPU seconds, by process (``admit*``: the client
    handing the admit step to the warm server; ``warm``: that server's forks)."""
    kinds = sorted({k for r in rows for k in r} - {"self", "steps"})
    print("round    self  steps | " + " ".join(f"{k:>9}" for k in kinds)
          + "   (CPU seconds; self: the supervisor, StreamFlow; steps: its children)")
    for i, r in enumerate(rows, 1):
        print(f"{i:>5} {r['self']:7.2f} {r['steps']:6.2f} | "
              + " ".join(f"{r.get(k, 0.0):9.2f}" for k in kinds))
