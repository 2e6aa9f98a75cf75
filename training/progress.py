"""The trainer's step lines: what a site's round is doing while it trains (rank 0 only).

``step 12/30 loss 3.4512 tokens/s 5120 eta 0:00:07 tokens/s/gpu 2560 mfu 41.3%`` on stdout
(a SLURM job's output file, StreamFlow's log) and appended to the file the launcher names
(``XFFL_STEP_LOG``: ``steps.log`` beside the update folder, in the step's own folder, which
``xffl logs --site S -f`` follows for a site on the coordinator's machine). Only a round
started by :mod:`xffl.training.launch` reports (the trainer called in-process, by ``xffl
simulate``'s workers or a benchmark, prints nothing).
A line for the first step, then one every ``XFFL_STEP_LOG_SECONDS`` seconds (default 10),
and one for the last step. ``tokens/s`` is the site's since the first step; ``tokens/s/gpu``
and ``mfu`` are one device's since the previous line (the loss's ``.item()`` before each
line waits for the device, so the interval is timed from sync to sync; ``mfu -`` where the
device's peak is not known). No torch here: the CLI imports the names.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STEP_LOG_ENV = "XFFL_STEP_LOG"  # the file the launcher asks the ranks to append to
STEP_LOG_FILE = "steps.log"  # its name in the step's working directory
INTERVAL_ENV = "XFFL_STEP_LOG_SECONDS"
DEFAULT_INTERVAL = 10.0
STEP_PREFIX = "step "


def step_interval(env: dict[str, str] | None = None) -> float:
    """Seconds between step lines (``XFFL_STEP_LOG_SECONDS``; unreadable: the default)."""
    raw = (os.environ if env is None else env).get(INTERVAL_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_INTERVAL
    return value if value >= 0 else DEFAULT_INTERVAL


def eta_text(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative duration."""
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


@dataclass(frozen=True)
class Speed:
    """What turns a site's tokens into one device's tokens/s and MFU."""

    devices: int = 1  # the site's ranks (GPUs, or CPU processes)
    flops_per_token: float = 0.0  # xffl.training.telemetry.flops_per_token
    peak_tflops: float | None = None  # the device's dense bf16 peak; None: unknown
    note: str = ""  # appended to every line (training.local_groups: its syncs' bytes)

    def text(self, tokens: float, seconds: float) -> str:
        """`` tokens/s/gpu R mfu M%`` of ``tokens`` (the site's) in ``seconds``."""
        per_device = tokens / max(self.devices, 1) / max(seconds, 1e-9)
        mfu = "-" if self.peak_tflops is None else \
            f"{100 * self.flops_per_token * per_device / 1e12 / self.peak_tflops:.1f}%"
        return f" tokens/s/gpu {per_device:.0f} mfu {mfu}{self.note}"


class StepReporter:
    """Decides when a step line is due and writes it (on the rank that reports)."""

    def __init__(self, total: int, log: Path | None, interval: float,
                 speed: Speed | None = None) -> None:
        """``total`` steps planned; ``log``: the file that also gets the lines."""
        self.total = total
        self.log = log
        self.interval = interval
        self.speed = speed or Speed()
        self.start = time.perf_counter()
        self.last: float | None = None
        self.last_tokens = 0

    @classmethod
    def from_env(cls, total: int, rank0: bool, speed: Speed | None = None) -> StepReporter | None:
        """Rank 0's reporter in a round the launcher started (``XFFL_STEP_LOG`` set); None
        on the other ranks and outside the launcher."""
        log = os.environ.get(STEP_LOG_ENV)
        return cls(total, Path(log), step_interval(), speed) if rank0 and log else None

    def due(self, done: int) -> bool:
        """Whether step ``done`` (1-based) gets a line: the first, the last, or one every
        interval."""
        return (self.last is None or done == self.total
                or time.perf_counter() - self.last >= self.interval)

    def report(self, done: int, loss: float, tokens: int) -> str:
        """Write the line of step ``done`` (``tokens``: the site's, all ranks, so far)."""
        now = time.perf_counter()
        since = now - (self.start if self.last is None else self.last)
        recent = self.speed.text(tokens - self.last_tokens, since)
        self.last, self.last_tokens = now, tokens
        elapsed = max(now - self.start, 1e-9)
        eta = (self.total - done) * elapsed / done
        line = (f"{STEP_PREFIX}{done}/{self.total} loss {loss:.4f} tokens/s "
                f"{tokens / elapsed:.0f} eta {eta_text(eta)}{recent}")
        print(line, flush=True)
        if self.log is not None:
            try:
                with self.log.open("a") as fh:
                    fh.write(line + "\n")
            except OSError as exc:  # the round goes on without its file
                print(f"xffl.training: cannot append to {self.log} ({exc.strerror}); step "
                      "lines go to stdout only", file=sys.stderr, flush=True)
                self.log = None
        return line
