"""Checkpoints inside a round, at the site: a job that ends early is continued, not restarted.

With ``training.checkpoint`` the ranks write a sharded checkpoint every ``every`` steps (or
minutes) with ``torch.distributed.checkpoint`` (``dcp.async_save`` on a gloo group of its own:
the training goes on while a thread writes) into the site's state folder (the launcher's
``--keep`` folder, never the update that crosses the border):

    <state>/checkpoints/<run>-r<round>-<global digest[:16]>/step-<k>/

holding dcp's files (its ``.metadata`` written last by the coordinator rank) and, written
atomically after the save finished, a ``complete`` marker: the run, round, global digest,
step, ranks, learning-rate schedule position and the sha256 of every file. What is saved:
the model and AdamW state (torch's ``get_state_dict``: DDP's whole tensors once, FSDP2's
shards by each rank), each rank's torch RNG (CPU, and CUDA where present), losses so far and
the data position (micro-batches read: the sampler is a pure function of seed, round and
rank, so a position is a count). A retried job looks for the newest complete checkpoint of
its own run, round and global model and with its own ranks; every other one is refused with
a log line saying why. Nothing here is unpickled: dcp's tensors are read into tensors of the
round's own state dict, the marker is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.optim.lr_scheduler import LambdaLR

from xffl.core.failpoints import ENV as FAILPOINT_ENV
from xffl.core.failpoints import failpoint
from xffl.core.files import write_json
from xffl.training import distributed as xdist
from xffl.training.chain_files import ROOT
from xffl.training.parallelize import ParallelModel
from xffl.training.round_spec import RoundCheckpointSpec

COMPLETE = "complete"
FORMAT = 1
#: failpoints (:mod:`xffl.core.failpoints`): die after step K once the checkpoints begun
#: before it are complete (``round-step-K``), or after dcp's files, before the marker
STEP_FAILPOINT = "round-step-{step}"
MARKER_FAILPOINT = "round-checkpoint-marker"
PAUSE = "@pause"
UNTIL = "@until="  # round-step-K@until=PATH: held after step K until PATH exists
_STEP_RE = re.compile(r"^step-([0-9]{1,9})$")
#: the line rank 0 prints when a checkpoint is complete; the failure manager reads it (bounded)
PROGRESS_LINE = "xffl.training: checkpoint complete: round {round} step {step}"


@dataclass(frozen=True)
class Identity:
    """What a checkpoint must match to be continued from."""

    run_id: str
    round: int
    parent: str  # the global model's manifest digest
    world: int

    def folder(self, state_dir: Path) -> Path:
        """This round's checkpoint folder in the site's state folder."""
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", self.run_id)
        return Path(state_dir) / ROOT / f"{run}-r{self.round}-{self.parent[:16]}"


@dataclass(frozen=True)
class Found:
    """A complete checkpoint to continue from."""

    path: Path
    step: int
    marker: dict[str, Any]


def files_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint (but its marker), by name."""
    out: dict[str, str] = {}
    for path in sorted(Path(folder).iterdir()):
        if path.name == COMPLETE or not path.is_file():
            continue
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        out[path.name] = digest.hexdigest()
    return out


def _judge(step_dir: Path, want: Identity) -> tuple[dict[str, Any] | None, str]:
    """(its marker, "") when ``step_dir`` may be continued from, else (None, why not)."""
    try:
        marker = json.loads((step_dir / COMPLETE).read_text())
        if not isinstance(marker, dict):
            raise ValueError("not an object")
    except FileNotFoundError:
        return None, "incomplete (no complete marker: the job ended during its save)"
    except (OSError, ValueError) as exc:
        return None, f"its complete marker is unreadable ({exc})"
    if marker.get("format") != FORMAT:
        return None, f"of another format ({marker.get('format')!r})"
    if marker.get("run_id") != want.run_id:
        return None, f"of another run ({marker.get('run_id')!r})"
    if marker.get("round") != want.round:
        return None, f"of round {marker.get('round')!r}, not {want.round}"
    if marker.get("parent") != want.parent:
        return None, (f"of another global model (digest {str(marker.get('parent'))[:16]}, "
                      f"this round's is {want.parent[:16]})")
    if marker.get("world") != want.world:
        return None, f"saved by {marker.get('world')!r} ranks, this job has {want.world}"
    step = marker.get("step")
    if not isinstance(step, int) or step < 1 or f"step-{step:06d}" != step_dir.name:
        return None, f"its marker's step {step!r} does not match its folder"
    if marker.get("files") != files_digest(step_dir):
        return None, "its files do not match the sha256 in its marker"
    return marker, ""


def newest_complete(state_dir: Path, want: Identity,
                    log: Callable[[str], None] | None = None) -> Found | None:
    """The newest checkpoint of ``want``'s run, round, global and ranks in ``state_dir``;
    every other one found is refused, each with a ``log`` line saying why."""
    root = Path(state_dir) / ROOT
    candidates = sorted(
        ((int(m.group(1)), d) for f in (root.iterdir() if root.is_dir() else [])
         if f.is_dir() for d in f.iterdir() if (m := _STEP_RE.match(d.name))),
        key=lambda item: (item[1].parent == want.folder(state_dir), item[0]), reverse=True)
    best: Found | None = None
    for _, step_dir in candidates:
        if best is not None and step_dir.parent == best.path.parent:
            continue  # an older one of the chosen round: not needed, not refused
        marker, why = _judge(step_dir, want)
        if marker is None:
            if log is not None:
                log(f"not continuing from checkpoint {step_dir}: {why}.")
            continue
        best = Found(step_dir, int(marker["step"]), marker)
    return best


def _state(pm: ParallelModel, optimizer: torch.optim.Optimizer, rank: int,
           losses: Tensor) -> dict[str, Any]:
    """What a checkpoint holds, as dcp saves and loads it (tensors only)."""
    model_sd, optim_sd = get_state_dict(pm.module, optimizer)
    own: dict[str, Tensor] = {"rng": torch.get_rng_state(), "losses": losses}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        own["cuda_rng"] = torch.cuda.get_rng_state()
    return {"model": model_sd, "optim": optim_sd, f"rank{rank}": own}


@dataclass
class Resumed:
    """Where a continued round stands: its step, losses so far and targets counted."""

    step: int
    losses: Tensor
    loss_tokens: int
    source: Path


def restore(found: Found, pm: ParallelModel, optimizer: torch.optim.Optimizer,
            scheduler: LambdaLR) -> Resumed:
    """Load a checkpoint into the round's model, optimizer, schedule and RNG (collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    step = found.step
    state = _state(pm, optimizer, rank, torch.zeros(step, dtype=torch.float64))
    dcp_load(state, checkpoint_id=str(found.path),
             no_dist=not dist.is_initialized())
    set_state_dict(pm.module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    own = state[f"rank{rank}"]
    torch.set_rng_state(own["rng"])
    if "cuda_rng" in own:
        torch.cuda.set_rng_state(own["cuda_rng"])
    sched = scheduler.state_dict()
    sched.update(found.marker["scheduler"])
    scheduler.load_state_dict(sched)
    return Resumed(step, own["losses"].clone(), int(found.marker["loss_tokens"]), found.path)


def _say(text: str) -> None:
    print(f"xffl.training: {text}", file=sys.stderr, flush=True)


class RoundCheckpointer:
    """Saves a round's checkpoints as it trains (every rank makes one; collective saves)."""

    def __init__(self, spec: RoundCheckpointSpec, state_dir: Path, want: Identity,
                 grad_accum: int) -> None:
        """Ready to save into ``want``'s folder of ``state_dir``."""
        self.spec, self.state_dir, self.want = spec, Path(state_dir), want
        self.folder = want.folder(state_dir)
        self.grad_accum = grad_accum
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # async_save's thread gathers its results: on a group of its own, so that it never
        # interleaves with the training's collectives
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        # "every: <N>m": the ranks agree each step whether it is time, on a third group
        # (the save's thread may be using its own at that moment)
        self.clock = dist.new_group(backend="gloo") if dist.is_initialized() and \
            spec.every_seconds is not None else None
        self.pending: Future[Any] | None = None
        self.marking: Future[None] | None = None
        self.pool = ThreadPoolExecutor(max_workers=1) if self.rank == 0 else None
        self.last_time = time.monotonic()
        self.saves = 0
        self.blocked = 0.0  # seconds the training waited for checkpoints
        self.written_bytes = 0
        self.saved_step = 0  # the step of the newest save begun
        self.last_cost = 0.0  # seconds the newest complete save took, to its marker

    def due(self, done: int, steps: int) -> bool:
        """Whether to save after step ``done`` (the same answer on every rank)."""
        if done >= steps:
            return False
        every = self.spec.every_steps
        if every is not None:
            return done % every == 0
        seconds = self.spec.every_seconds or 0.0
        late = torch.tensor([1.0 if time.monotonic() - self.last_time >= seconds else 0.0])
        if dist.is_initialized():
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=self.clock)
        return bool(late.item() > 0)

    def save(self, done: int, pm: ParallelModel, optimizer: torch.optim.Optimizer,
             scheduler: LambdaLR, losses: Tensor, loss_tokens: int) -> float:
        """Start the checkpoint of step ``done``; the seconds the training waited for it."""
        began = time.perf_counter()
        self.wait()  # one save at a time
        step_dir = self.folder / f"step-{done:06d}"
        if self.rank == 0:
            if self.saves == 0:
                self._drop_others()
            shutil.rmtree(step_dir, ignore_errors=True)
            step_dir.mkdir(parents=True, mode=0o700)
        if dist.is_initialized():
            dist.barrier(group=self.group)
        state = _state(pm, optimizer, self.rank, losses[:done].detach().cpu().clone())
        marker = {"format": FORMAT, "run_id": self.want.run_id, "round": self.want.round,
                  "parent": self.want.parent, "world": self.want.world, "step": done,
                  "micro_batches": done * self.grad_accum, "loss_tokens": loss_tokens,
                  "scheduler": {k: v for k, v in scheduler.state_dict().items()
                                if k in ("last_epoch", "_step_count", "_last_lr")}}
        pending = async_save(state, checkpoint_id=str(step_dir), process_group=self.group,
                             no_dist=not dist.is_initialized())
        # the default thread saver answers a Future (AsyncSaveResponse: with a stager of
        # its own, which this does not pass)
        assert isinstance(pending, Future)
        self.pending = pending
        if self.pool is not None:
            self.marking = self.pool.submit(self._mark, pending, step_dir, marker)
        self.saves += 1
        self.saved_step = done
        self.last_time = time.monotonic()
        blocked = time.perf_counter() - began
        self.blocked += blocked
        return blocked

    def _mark(self, pending: Future[Any], step_dir: Path, marker: dict[str, Any]) -> None:
        """Rank 0, in its thread: once dcp's save finished (its metadata written after every
        rank's files), write the ``complete`` marker and keep the newest ``keep``."""
        began = time.perf_counter()
        pending.result()
        files = files_digest(step_dir)
        failpoint(MARKER_FAILPOINT)  # dies as a kill during the save would leave it
        # seconds from the end of the training's wait to the marker: what a save before a
        # time limit must be given
        self.last_cost = time.perf_counter() - began
        write_json(step_dir / COMPLETE, {**marker, "files": files,
                                         "seconds": round(self.last_cost, 3)})
        os.chmod(step_dir / COMPLETE, 0o600)
        size = sum((step_dir / name).stat().st_size for name in files)
        self.written_bytes += size
        print(PROGRESS_LINE.format(round=marker["round"], step=marker["step"])
              + f" ({size / 1e6:.1f} MB, written in {time.perf_counter() - began:.2f} s "
              "beside the training)", file=sys.stderr, flush=True)
        kept = sorted((d for d in self.folder.iterdir() if _STEP_RE.match(d.name)),
                      reverse=True)
        complete = [d for d in kept if (d / COMPLETE).is_file()]
        for old in kept:
            if old not in complete[:self.spec.keep] and old.name < complete[0].name:
                shutil.rmtree(old, ignore_errors=True)

    def _drop_others(self) -> None:
        """Remove other rounds' and globals' checkpoints (refused when this round began)."""
        root = self.state_dir / ROOT
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for other in root.iterdir():
            if other != self.folder:
                shutil.rmtree(other, ignore_errors=True)

    def failpoint(self, done: int) -> None:
        """Rank 0: the ``round-step-K`` failpoint, once the checkpoints begun are complete
        (the kill of a test that a checkpoint was written before, without sleeping);
        ``round-step-K@pause`` stops the round there until the job is killed (scancel),
        ``round-step-K@until=PATH`` until PATH exists (a test's event), then goes on."""
        name = STEP_FAILPOINT.format(step=done)
        wanted = os.environ.get(FAILPOINT_ENV, "")
        if self.rank == 0 and wanted.split("@")[0] == name:
            self.wait()
            if wanted == name + PAUSE:
                _say(f"failpoint {wanted}: paused after step {done} until the job is killed.")
                threading.Event().wait()
            if wanted.startswith(name + UNTIL):
                release = Path(wanted[len(name + UNTIL):])
                _say(f"failpoint {name}: held after step {done} until {release} exists.")
                while not release.exists():
                    time.sleep(0.2)
                return
            failpoint(name)
            failpoint(name + "@group")

    def wait(self) -> None:
        """Block until the save under way (and its marker) is done."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        if self.marking is not None:
            self.marking.result()
            self.marking = None

    def close(self) -> None:
        """Wait for the last save and free the thread and the group."""
        began = time.perf_counter()
        self.wait()
        self.blocked += time.perf_counter() - began
        if self.pool is not None:
            self.pool.shutdown()
        for group in (self.group, self.clock):
            if group is not None:
                dist.destroy_process_group(group)
        self.group = self.clock = None


def begin(spec: RoundCheckpointSpec, state_dir: Path, want: Identity, grad_accum: int,
          pm: ParallelModel, optimizer: torch.optim.Optimizer,
          scheduler: LambdaLR) -> tuple[Resumed | None, RoundCheckpointer]:
    """Continue from the newest complete checkpoint of this round, if any (rank 0 chooses and
    logs every refusal), and the checkpointer of the rest of the round (collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    found = newest_complete(state_dir, want, log=_say) if rank == 0 else None
    chosen = xdist.broadcast_str(None if found is None else json.dumps(
        {"path": str(found.path), "step": found.step, "marker": found.marker}))
    resumed: Resumed | None = None
    if chosen is not None:
        data = json.loads(chosen)
        resumed = restore(Found(Path(data["path"]), int(data["step"]), data["marker"]),
                          pm, optimizer, scheduler)
        if rank == 0:
            _say(f"continuing round {want.round} at step {resumed.step} from checkpoint "
                 f"{resumed.source}.")
    elif rank == 0:
        _say(f"round {want.round} starts from the global model: no complete checkpoint of "
             f"this run, round and global model in {Path(state_dir) / ROOT}.")
    return resumed, RoundCheckpointer(spec, state_dir, want, grad_accum)


def step_hook(saver: RoundCheckpointer | None, steps: int,
              pm: ParallelModel, optimizer: torch.optim.Optimizer, scheduler: LambdaLR
              ) -> Callable[[int, Tensor, int], None] | None:
    """What runs after each optimizer step: a checkpoint when one is due (none without
    ``training.checkpoint``)."""
    if saver is None:
        return None

    def after_step(done: int, so_far: Tensor, loss_tokens: int) -> None:
        if saver.due(done, steps):
            saver.save(done, pm, optimizer, scheduler, so_far, loss_tokens)
        saver.failpoint(done)

    return after_step


def manifest_record(saver: RoundCheckpointer | None,
                    resumed: Resumed | None) -> dict[str, Any]:
    """The update manifest's record of the round's checkpoints: saves, seconds training
    waited on them, the step it continued from (nothing without ``training.checkpoint``)."""
    if saver is None:
        return {}
    return {"checkpoints": {"saved": saver.saves, "blocked_seconds": saver.blocked,
                            "resumed_at": 0 if resumed is None else resumed.step}}
