"""Rounds longer than one job (``training.checkpoint.chain``): the job saves and ends before
its time limit, and the next job of the site continues the round.

SLURM signals the batch shell ``USR1`` a margin before the time limit (``--signal=B:USR1@M``,
written by the one batch template, M from :func:`xffl.training.round_spec.chain_margin`); the
shell passes it to the launcher, which leaves a request in the site's state folder
(:data:`STOP_FILE`). After each optimizer step the ranks agree (one all-reduce of a flag, so
every rank stops at the same step) whether to stop: the request, a ``USR1`` sent to a rank
itself, or the trainer's own guard (the SLURM end time minus the margin, the last step's
seconds included). Stopping, they write the step's checkpoint (waiting for any save under
way), rank 0 prints the progress line and :data:`CONTINUE_LINE` and leaves its account of
the job in :data:`END_FILE`, and the launcher exits with
:data:`~xffl.training.chain_files.CONTINUE_EXIT` (no update written). The launcher keeps the
list of the round's jobs (:data:`JOBS_FILE`: job id, steps from and to, queue wait, run
time, how it ended); the job that finishes the round hands it back in ``slurm_job.json``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from xffl.core.errors import ExitCode, XfflError
from xffl.core.failpoints import ENV as FAILPOINT_ENV
from xffl.core.files import write_json
from xffl.training import distributed as xdist
from xffl.training.chain_files import CONTINUE_LINE, END_FILE, STOP_FILE
from xffl.training.parallelize import ParallelModel
from xffl.training.round_spec import RoundCheckpointSpec, chain_margin, checkpoint_seconds
from xffl.training.round_state import Resumed, RoundCheckpointer, step_hook

WAIT_FAILPOINT = "chain-wait-{step}"  # xffl.core.failpoints' variable: see should_stop


class RoundContinues(XfflError):
    """The job saved the round's checkpoint and ends; the next job continues the round."""

    exit_code = ExitCode.CONTINUED


class StopWatch:
    """Whether a chained round's job must stop now (every rank makes one; collective)."""

    def __init__(self, state_dir: Path, round: int, parent: str, steps: int, first: int,
                 end_time: float | None, parameters: int) -> None:
        """Watch for a stop request from the step after ``first`` on (installs a USR1
        handler: a signal sent to a rank asks for the stop too)."""
        self.state_dir, self.round, self.parent = Path(state_dir), round, parent
        self.steps, self.first, self.end_time = steps, first, end_time
        self.declared = checkpoint_seconds(parameters)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.asked = False
        self.last = time.monotonic()
        self.began = self.last
        if sys.platform != "win32":
            signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.asked = True

    def should_stop(self, done: int, measured_cost: float) -> bool:
        """After step ``done``: whether any rank wants to stop (the same answer on every
        rank). The failpoint ``chain-wait-K`` holds rank 0 after step K until a stop is asked
        (a test's signal lands at a known step, with no sleep in the test)."""
        if self.rank == 0 and os.environ.get(FAILPOINT_ENV) == WAIT_FAILPOINT.format(step=done):
            print(f"xffl.training: failpoint {WAIT_FAILPOINT.format(step=done)}: waiting for "
                  "the stop request.", file=sys.stderr, flush=True)
            while not (self.asked or (self.state_dir / STOP_FILE).exists()):
                time.sleep(0.05)
        now = time.monotonic()
        step_seconds, self.last = now - self.last, now
        want = self.asked or (self.rank == 0 and (self.state_dir / STOP_FILE).exists())
        if self.end_time is not None:
            margin = chain_margin(max(self.declared, measured_cost))
            want = want or time.time() + step_seconds >= self.end_time - margin
        flag = torch.tensor([1.0 if want else 0.0])
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item() > 0)

    def finish(self, done: int, continues: bool) -> None:
        """Rank 0: leave the account of this job for the launcher (and print the line)."""
        if self.rank != 0:
            return
        ran = max(done - self.first, 0)
        per_step = (time.monotonic() - self.began) / ran if ran else 0.0
        if continues:
            print(CONTINUE_LINE.format(round=self.round, step=done, steps=self.steps)
                  + f" ({per_step:.3f} s/step)", file=sys.stderr, flush=True)
        write_json(self.state_dir / END_FILE, {
            "round": self.round, "parent": self.parent, "from": self.first, "to": done,
            "steps": self.steps, "continues": continues, "step_seconds": round(per_step, 3)})

    def close(self) -> None:
        """Free the group and give USR1 its default back."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        if sys.platform != "win32":
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def hook(after_step: Callable[[int, Tensor, int], None] | None, watch: StopWatch | None,
         saver: RoundCheckpointer, save: Callable[[int, Tensor, int], None]
         ) -> Callable[[int, Tensor, int], None] | None:
    """The step hook of a chained round: the checkpoint hook, then the agreement to stop;
    stopping, the step's checkpoint (unless just begun) is written and waited for, and
    :class:`RoundContinues` ends the job."""
    if watch is None:
        return after_step

    def after(done: int, so_far: Tensor, loss_tokens: int) -> None:
        if after_step is not None:
            after_step(done, so_far, loss_tokens)
        if done >= watch.steps or not watch.should_stop(done, saver.last_cost):
            return
        if saver.saved_step != done:
            save(done, so_far, loss_tokens)
        saver.wait()
        watch.finish(done, continues=True)
        raise RoundContinues(CONTINUE_LINE.format(round=watch.round, step=done,
                                                  steps=watch.steps)[len("xffl.training: "):])

    return after


def begin(spec: RoundCheckpointSpec | None, saver: RoundCheckpointer | None,
          state_dir: Path | None, round: int, parent: str, steps: int,
          resumed: Resumed | None, pm: ParallelModel, optimizer: torch.optim.Optimizer,
          scheduler: LambdaLR
          ) -> tuple[Callable[[int, Tensor, int], None] | None, StopWatch | None]:
    """The round's step hook (its checkpoints, :func:`round_state.step_hook`) and, with
    ``training.checkpoint.chain`` and a state folder, the stop watch of a round of several
    jobs (else None). Collective."""
    after_step = step_hook(saver, steps, pm, optimizer, scheduler)
    if spec is None or not spec.chain or saver is None or state_dir is None:
        return after_step, None
    parameters = sum(p.numel() for p in pm.module.parameters())
    watch = StopWatch(state_dir, round, parent, steps, 0 if resumed is None else resumed.step,
                      xdist.job_end_time(), parameters)

    def save(done: int, so_far: Tensor, loss_tokens: int) -> None:
        saver.save(done, pm, optimizer, scheduler, so_far, loss_tokens)

    return hook(after_step, watch, saver, save), watch
