"""One site's local training round: load the global model, train it on the site's mesh,
evaluate it, write the update (checkpoint I/O: :mod:`checkpoint`; the optimizer:
:mod:`optimizer`).

Every rank loads the global checkpoint (safetensors only, never torch.load), trains
``steps`` AdamW steps on its disjoint share of the site's sequences (DDP averages the
gradients, so the ranks stay identical), and rank 0 writes the update checkpoint in the
exchange format of :mod:`xffl.aggregator.exchange`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.optim.lr_scheduler import LambdaLR

from xffl.aggregator.exchange import (
    Manifest,
    verify_checkpoint,
)
from xffl.aggregator.kinds import LORA_ADAPTER
from xffl.core.errors import InvalidInput, RunFailed, XfflError
from xffl.training import chain, local_groups, lora, round_state
from xffl.training import distributed as xdist
from xffl.training.checkpoint import load_model, read_config, read_weights
from xffl.training.config import TrainingSpec, TrainJob, round_steps
from xffl.training.data import TokenShards, site_splits
from xffl.training.evaluate import evaluate_net
from xffl.training.launch import LAUNCHED_AT_ENV
from xffl.training.loop import make_scheduler, prox_snapshot, run_steps
from xffl.training.memory_model import model_parts
from xffl.training.model import ModelConfig
from xffl.training.optimizer import make_optimizer, rank_seed
from xffl.training.parallelize import (
    ParallelModel,
    check_tensor_parallel,
    data_parallel_mode,
    device_memory,
    parallelize,
)
from xffl.training.round_report import held_out_evaluation, round_report
from xffl.training.sharded_load import load_parallel
from xffl.training.telemetry import (
    device_count,
    device_name,
    round_speed,
)
from xffl.training.update_save import (
    drain,
    gather_tensors,
    global_update_nbytes,
    save_update,
    time_margin,
)

T = TypeVar("T")


def _on_main(fn: Callable[[], T], encode: Callable[[T], str],
             decode: Callable[[str], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result, or raise its error on all."""
    if not xdist.is_distributed():
        return fn()
    payload: str | None = None
    failure: BaseException | None = None
    error: str | None = None
    if xdist.rank() == 0:
        try:
            payload = encode(fn())
        except XfflError as exc:
            failure, error = exc, exc.message
        except Exception as exc:
            failure, error = exc, f"{type(exc).__name__}: {exc}"
    message = json.loads(xdist.broadcast_str(json.dumps({"payload": payload, "error": error}))
                         or "{}")
    if failure is not None:
        raise failure
    if message.get("error"):
        raise RunFailed(f"rank 0 failed: {message['error']}")
    return decode(message["payload"])


def _site_device() -> torch.device:
    return xdist.device_for(xdist.detect_env())


def round_deadline(spec: TrainingSpec, reserve: float = 0.0,
                   save_bytes: int = 0) -> float | None:
    """When this round must stop training: its time budget from now, or the SLURM limit
    minus the margin (``auto``: sized by the update's ``save_bytes``) and ``reserve``
    seconds (the update's evaluation after training)."""
    now = time.time()
    ends = [now + spec.time_budget] if spec.time_budget is not None else []
    chained = spec.checkpoint is not None and spec.checkpoint.chain  # continues instead
    slurm_end = None if chained else xdist.job_end_time()
    if slurm_end is not None:
        ends.append(slurm_end - time_margin(spec.time_margin, save_bytes) - reserve)
    return min(ends) if ends else None


def startup_seconds(env: Mapping[str, str], now: float) -> float | None:
    """Seconds since the launcher started this job's ranks (None outside the launcher)."""
    try:
        launched_at = float(env[LAUNCHED_AT_ENV])
    except (KeyError, ValueError):
        return None
    return max(0.0, now - launched_at) if math.isfinite(launched_at) else None


def _site_data(job: TrainJob, data_dir: Path, config: ModelConfig,
               world: int) -> tuple[TokenShards, TokenShards | None]:
    """The site's training and held-out token shards, checked against the model and mesh."""
    spec = job.training
    if spec.seq_len > config.max_position_embeddings:
        raise InvalidInput(
            f"training.seq_len {spec.seq_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings})."
        )
    check_tensor_parallel(config, spec.tensor_parallel, world)
    shards, held_out = site_splits(data_dir, job.data, spec.seq_len)
    for part in (shards, held_out):
        if part is not None and part.vocab_size > config.vocab_size:
            raise InvalidInput(
                f"{part.path}: vocabulary of {part.vocab_size} tokens does not fit the model's "
                f"vocab_size {config.vocab_size}."
            )
    return shards, held_out


def _write_update(job: TrainJob, pm: ParallelModel, model_dir: Path, out_dir: Path,
                  config: ModelConfig, manifest: Manifest,
                  state_dir: Path | None = None) -> Manifest:
    """Gather the trained state (collective) and write the update on rank 0; every rank
    gets its manifest. A LoRA job gathers and writes only the adapter. ``state_dir``: the
    site's own folder (error feedback's residual, :mod:`xffl.training.feedback`)."""
    if job.training.lora is not None:
        # collective; only the adapter's tensors are gathered and copied
        state = lora.adapter_state(pm.module, pm.full_state_dict(lora.is_adapter_param))
        adapter_config = (model_dir / LORA_ADAPTER.config_file).read_text()

        def save() -> Manifest:  # rank 0 holds the adapter (a few MB), written as a model
            names = sorted(state)
            return save_update(((n, state[n]) for n in names),
                               {n: tuple(state[n].shape) for n in names}, adapter_config,
                               out_dir, manifest, job.exchange, model_dir, state_dir,
                               config_file=LORA_ADAPTER.config_file,
                               tensor_file=LORA_ADAPTER.tensor_file)
    else:
        # streamed: one tensor gathered (collective), encoded and written at a time
        shapes, gathered = gather_tensors(pm)

        def save() -> Manifest:
            return save_update(gathered, shapes, config.to_json(), out_dir, manifest,
                               job.exchange, model_dir, state_dir)

        if xdist.is_distributed() and xdist.rank() != 0:
            drain(gathered)  # every rank takes part in every gather
    written = _on_main(save, lambda m: m.model_dump_json(), Manifest.model_validate_json)
    xdist.barrier()
    return written


def site_model(job: TrainJob, weights_dir: Path, model_dir: Path, config: ModelConfig,
               device: torch.device) -> ParallelModel:
    """The global model of this round on the site's mesh, ready to train.

    A transformers model whose ranks hold slices (FSDP2, tensor parallel) is built on the
    meta device and loaded tensor by tensor into its slices (:mod:`sharded_load`), a LoRA
    job's frozen base too (wrapped by peft first, :func:`lora.load_sliced_adapted`); a
    replicated one (DDP, one rank) and a ``model.entry_point`` model are loaded whole at
    every rank. A LoRA job's frozen base is kept in bf16 when the round computes in bf16.
    """
    spec = job.training
    every = spec.checkpoint_every
    if every and job.model.entry_point is not None:
        raise InvalidInput("training.activation_checkpointing needs a transformers model; "
                           "a model.entry_point model must checkpoint its own blocks.")
    # counted from config.json as xffl validate counts it (no meta-device model built)
    params = model_parts(config).total if job.model.entry_point is None and \
        spec.data_parallel == "auto" and spec.tensor_parallel == 1 and \
        xdist.world_size() > 1 else 0  # auto's choice needs the size (one rank: no choice)
    sliced = data_parallel_mode(spec.data_parallel, spec.tensor_parallel, params,
                                device_memory(device)) == "fsdp"
    dtype = lora.frozen_dtype(spec.precision, device) if spec.lora is not None \
        else torch.float32
    groups = local_groups.check(spec, xdist.world_size())
    if sliced and xdist.world_size() > 1 and job.model.entry_point is None:
        if spec.lora is not None:
            return lora.load_sliced_adapted(weights_dir, model_dir, config, spec.lora,
                                            job.freeze_a, device, spec.data_parallel,
                                            every, dtype, precision=spec.precision,
                                            compile=spec.compile,
                                            shard_group=spec.shard_group)
        return load_parallel(weights_dir, config, spec.tensor_parallel, device,
                             spec.data_parallel, every, precision=spec.precision,
                             compile=spec.compile, shard_group=spec.shard_group,
                             groups=groups)
    model = load_model(weights_dir, job.model.entry_point, dtype)
    if spec.lora is not None:  # checkpointing reaches the decoder layers through peft
        model = lora.wrap(model, spec.lora, job.freeze_a)
        lora.load_adapter(model, read_weights(model_dir), model_dir)
    return parallelize(model.to(device), spec.tensor_parallel, device, spec.data_parallel,
                       precision=spec.precision, checkpointing=every, compile=spec.compile,
                       shard_group=spec.shard_group, groups=groups)


def _round_checkpoints(job: TrainJob, round: int, parent: str, state_dir: Path | None,
                       pm: ParallelModel, optimizer: torch.optim.Optimizer, scheduler: LambdaLR
                       ) -> tuple[round_state.Resumed | None, round_state.RoundCheckpointer | None]:
    """``training.checkpoint``: the checkpoint this round continues from, and its saver."""
    spec = job.training.checkpoint
    if spec is None:
        return None, None
    if state_dir is None:
        if xdist.rank() == 0:
            print("xffl.training: warning: training.checkpoint is set but this job has no "
                  "site state folder (the launcher's --keep); no checkpoint is written.",
                  file=sys.stderr, flush=True)
        return None, None
    want = round_state.Identity(job.run_id, round, parent, xdist.world_size())
    return round_state.begin(spec, Path(state_dir), want, job.training.grad_accum, pm,
                             optimizer, scheduler)


def _layout_record(job: TrainJob, pm: ParallelModel, device: torch.device,
                   world: int) -> dict[str, Any]:
    """The update manifest's record of how the site ran the round: ranks, mesh, device,
    threads, batch shape and exchange."""
    spec = job.training
    return {"world_size": world, "dp": pm.dp_size, "tp": pm.tp_size,
            "device": device_name(device), "gpus": device_count(device, world),
            "threads": torch.get_num_threads(), "batch_size": spec.batch_size,
            "grad_accum": spec.grad_accum, "seq_len": spec.seq_len,
            "exchange": job.exchange.label()}


def train_round(job: TrainJob, round: int, model_dir: Path, data_dir: Path,
                out_dir: Path, base_dir: Path | None = None,
                state_dir: Path | None = None) -> Manifest:
    """Train the global model in ``model_dir`` on this site's data; rank 0 writes the update.

    Works under an initialised process group (a (dp, tp) mesh of its ranks, see
    :mod:`xffl.training.parallelize`) or in a single process. Returns the update's manifest
    on every rank. A LoRA job (``training.lora``) trains the global adapter in ``model_dir``
    on the frozen model in ``base_dir`` and writes only the adapter. ``state_dir``: the
    site's own folder, where a quantized exchange keeps its error feedback.
    """
    spec = job.training
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    world = xdist.world_size()
    device = _site_device()
    if spec.lora is not None and base_dir is None:
        raise InvalidInput("a LoRA job needs its base model: pass --base DIR.")
    weights_dir = Path(base_dir) if spec.lora is not None and base_dir is not None \
        else model_dir

    parent = _on_main(lambda: verify_checkpoint(model_dir).digest(), str, str)
    config = read_config(weights_dir)
    shards, held_out = _site_data(job, data_dir, config, world)
    pm = site_model(job, weights_dir, model_dir, config, device)
    torch.manual_seed(rank_seed(spec.seed, round, pm.dp_rank))
    optimizer = make_optimizer(pm.module, spec)
    steps = round_steps(spec, pm.dp_size)
    scheduler = make_scheduler(optimizer, spec, offset=(round - 1) * steps,
                               total=job.rounds * steps)
    prox = prox_snapshot(pm) if spec.prox_mu > 0 else None
    resumed, saver = _round_checkpoints(job, round, parent, state_dir, pm, optimizer,
                                        scheduler)
    skip = 0 if resumed is None else resumed.step * spec.grad_accum
    batches = shards.batches(spec.batch_size, pm.dp_rank, pm.dp_size, spec.seed, round,
                             skip=skip)

    xdist.barrier()
    startup = startup_seconds(os.environ, time.time())

    validate = functools.partial(held_out_evaluation, job, pm, held_out, device)
    eval_began = time.perf_counter()
    incoming = validate()  # the global model this round starts from
    eval_seconds = time.perf_counter() - eval_began
    # time_budget is training time; the update's evaluation (as long as this one) must also
    # fit before the SLURM limit
    deadline = _on_main(lambda: round_deadline(
        spec, reserve=eval_seconds, save_bytes=global_update_nbytes(model_dir, job.exchange)),
        json.dumps, json.loads)
    sync = local_groups.make_sync(spec.local_groups, pm, optimizer, steps, state_dir, round)
    speed = local_groups.noted(round_speed(pm.module, config, spec.seq_len, device, world), sync)
    after_step, watch = chain.begin(spec.checkpoint, saver, state_dir, round, parent, steps,
                                    resumed, pm, optimizer, scheduler)
    after_step = local_groups.chain(sync, after_step)
    try:
        result = run_steps(pm, optimizer, scheduler, batches, steps, spec, device,
                           deadline=deadline, check_deadline=deadline is not None, prox=prox,
                           masked=shards.flags is not None, speed=speed,
                           resume=None if resumed is None else (resumed.losses,
                                                                resumed.loss_tokens),
                           after_step=after_step)
        if watch is not None:
            watch.finish(len(result.losses), continues=False)
    finally:
        for part in (saver, watch):
            if part is not None:
                part.close()
    if sync is not None:  # the site's update: the groups' result
        sync.finish()
    eval_began = time.perf_counter()
    trained = validate()  # this site's update
    eval_seconds += time.perf_counter() - eval_began
    losses, read, metrics = round_report(
        job, pm, device, result, speed, float(scheduler.get_last_lr()[0]), startup,
        incoming, trained, eval_seconds)
    done = len(losses)
    # the tokens the round trained on: the targets in the loss (every target of text data;
    # of instruction and chat data, the responses), the FedAvg weight under weighting: tokens
    num_tokens = result.loss_tokens
    # a site's FedAvg weight: its dataset's size where the job declares it (the coordinator
    # bounds the report by that), else the samples the round read, which it can bound
    num_samples = len(shards) if job.data.declared_samples is not None else \
        min(len(shards), read)
    metrics.update(sync.metrics() if sync is not None else {})
    manifest = Manifest(
        kind="update",
        run_id=job.run_id,
        round=round,
        site=job.site,
        num_samples=num_samples,
        num_tokens=num_tokens,
        metrics=metrics,
        parent=parent,
        extra={**_layout_record(job, pm, device, world), "steps": done,
               "steps_planned": steps, "stopped_early": result.stopped_early,
               **round_state.manifest_record(saver, resumed),
               "losses": [float(v) for v in losses] if done <= 1000 else []},
    )
    return _write_update(job, pm, model_dir, out_dir, config, manifest, state_dir)


def evaluate(model_dir: Path, data_dir: Path, seq_len: int, max_batches: int,
             batch_size: int = 8, entry_point: str | None = None) -> float:
    """Mean next-token loss of a checkpoint on the first sequences of a dataset (no grad)."""
    model = load_model(Path(model_dir), entry_point)
    shards = TokenShards(Path(data_dir), seq_len)
    count = min(len(shards), max_batches * batch_size)
    if count == 0:
        raise InvalidInput(f"{data_dir}: no sequence of {seq_len + 1} tokens to evaluate on.")
    return evaluate_net(model, shards, count, batch_size, torch.device("cpu"), "fp32").loss
