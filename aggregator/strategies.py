"""Aggregation under any registered strategy, streamed tensor by tensor, slice by slice.

The strategies themselves (names, parameters, server state, steps) are the registry's
(:mod:`xffl.aggregator.strategy_catalog`). Here they are applied to checkpoints: one slice
(``fedavg.SLICE_ELEMENTS`` elements) of every update, of the previous global and of the
server state is in memory at a time, whatever the model size. Arithmetic is float64;
outputs are cast to the model's dtypes like :mod:`xffl.aggregator.fedavg` does.

Server state (m, v or the momentum buffer) is stored in fp32 as one safetensors file per
buffer beside the global model (``server_m.safetensors``, ``server_v.safetensors``,
``server_momentum.safetensors``, tensors named as in the model), listed and checksummed in
the manifest, and read back from the previous global's directory at the next round; a
previous global without it (or written by another strategy) starts from zeros. Only
floating-point tensors have state; integer and bool tensors get the rounded weighted mean.
Updates of weight 0 are left out of every strategy, as in FedAvg.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.decode import Decoding
from xffl.aggregator.dtypes import decode, encode
from xffl.aggregator.exchange import Manifest, TensorInfo, index_of, read_manifest
from xffl.aggregator.fedavg import SLICE_ELEMENTS, aggregate
from xffl.aggregator.inputs import (
    Update,
    own_config,
    prepared,
    write_global,
)
from xffl.aggregator.strategy_catalog import Strategy, Weighting, get, resolve_params
from xffl.aggregator.robust import cap_shares, clip_factors, delta_norm
from xffl.aggregator.safetensors_io import (
    FLOAT_DTYPES,
    STORAGE_DTYPES,
    SafetensorsReader,
    SafetensorsWriter,
)
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import MODEL_FILE, ModelReader, open_model
from xffl.aggregator.verify import layout_difference
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.core.sizes import parse_size

Progress = Callable[[int, int], None]

def state_file(buffer: str) -> str:
    """The file name of one server-state buffer inside a global checkpoint."""
    return f"server_{buffer}.safetensors"


def _open_previous(
    strategy: Strategy, previous: Path | None, layout: list[TensorInfo], stack: ExitStack
) -> tuple[ModelReader | None, dict[str, SafetensorsReader], bool]:
    """Open the previous global's model and, when it has one for ``strategy``, its state."""
    name = strategy.name
    if previous is None:
        if strategy.state or strategy.steps:
            raise InvalidInput(f"strategy {name} needs the previous global checkpoint.")
        return None, {}, False
    previous = Path(previous)
    manifest = read_manifest(previous)
    model = stack.enter_context(open_model(previous))
    diff = layout_difference(index_of(model), layout, "the updates")
    if diff:
        raise CheckpointError(f"previous global {previous}: {diff}.")
    buffers = strategy.state
    files = [state_file(b) for b in buffers]
    same = manifest.extra.get("aggregation") == name
    if not buffers or not same or not all(f in manifest.files for f in files):
        return model, {}, False
    want = [(t.name, t.shape) for t in layout if t.dtype in FLOAT_DTYPES]
    state: dict[str, SafetensorsReader] = {}
    for b, f in zip(buffers, files, strict=True):
        state[b] = stack.enter_context(SafetensorsReader(previous / f))
        if [(t.name, t.shape) for t in index_of(state[b])] != want:
            raise CheckpointError(f"previous global {previous}: {f} does not match the model.")
    return model, state, True


def _write(
    strategy: Strategy,
    p: Mapping[str, float],
    active: list[Update],
    layout: list[TensorInfo],
    tmp: Path,
    previous: tuple[ModelReader | None, dict[str, SafetensorsReader]],
    metadata: Mapping[str, str],
    progress: Progress | None,
    max_shard_bytes: int | None = None,
    clips: Sequence[float] | None = None,
    single_file: str = MODEL_FILE,
) -> dict[str, str]:
    """Stream the strategy's output (and new server state) into ``tmp``; return sha256s.

    ``clips``: each update's change from the previous global is scaled by its factor
    (:func:`xffl.aggregator.robust.clip_factors`) before it enters the mean.
    """
    prev_model, prev_state = previous
    weights = [u.weight for u in active]
    total = math.fsum(weights)
    buffers = strategy.state
    floats = [t for t in layout if t.dtype in FLOAT_DTYPES]
    with ExitStack() as stack:
        entries = [(t.name, t.dtype, t.shape) for t in layout]
        model = stack.enter_context(
            ShardedWriter(tmp, entries, metadata, max_shard_bytes=max_shard_bytes,
                          single_file=single_file)
        )
        state_out = {
            b: stack.enter_context(
                SafetensorsWriter(
                    tmp / state_file(b),
                    [(t.name, "F32", t.shape) for t in floats],
                    {"strategy": strategy.name, "buffer": b},
                )
            )
            for b in buffers
        }
        for done, t in enumerate(layout, 1):
            numel = math.prod(t.shape)
            dt = STORAGE_DTYPES[t.dtype]
            for lo in range(0, max(1, numel), SLICE_ELEMENTS):
                hi = min(lo + SLICE_ELEMENTS, numel)
                stack_ = np.empty((len(active), hi - lo), dtype=np.float64)
                for i, u in enumerate(active):
                    raw = u.reader.read_into(t.name, lo, np.empty(hi - lo, dtype=dt))
                    stack_[i] = decode(raw, t.dtype)
                floating = t.dtype in FLOAT_DTYPES and prev_model is not None
                x = decode(prev_model.raw(t.name, lo, hi), t.dtype) if floating and (
                    strategy.steps or clips is not None) and prev_model is not None else None
                if strategy.robust:
                    result = strategy.combine(p, stack_)
                else:
                    result = np.zeros(hi - lo, dtype=np.float64)
                    for i, (w, row) in enumerate(zip(weights, stack_, strict=True)):
                        if clips is not None and clips[i] != 1.0 and x is not None:
                            row = x + clips[i] * (row - x)
                        result += w * row
                    result /= total
                if strategy.steps and x is not None:
                    state = {
                        b: (
                            decode(prev_state[b].raw(t.name, lo, hi), "F32")
                            if prev_state
                            else np.zeros(hi - lo, dtype=np.float64)
                        )
                        for b in buffers
                    }
                    result = strategy.step(p, x, result, state)
                    for b in buffers:
                        state_out[b].write_chunk(t.name, state[b].astype(np.float32))
                out = np.empty(hi - lo, dtype=dt)
                encode(result, t.dtype, out, np.empty(hi - lo, dtype=np.float32))
                model.write_chunk(t.name, out)
            if progress is not None:
                progress(done, len(layout))
    sums = model.checksums
    sums.update({state_file(b): w.sha256 for b, w in state_out.items()})
    return sums


def _cap_shares(active: list[Update], sites: dict[str, dict[str, Any]],
                max_weight_share: float | None) -> dict[str, Any]:
    """Cap each update's share of the weight (``max_weight_share``), updating the sites'
    summary; return the bounds the manifest records."""
    if max_weight_share is None:
        return {}
    for u, w in zip(active, cap_shares([u.weight for u in active], max_weight_share),
                    strict=True):
        u.weight = w
    total = math.fsum(u.weight for u in active)
    for u in active:
        sites[u.site]["weight"] = u.weight / total
    return {"max_weight_share": max_weight_share}


def _clips(active: list[Update], previous: ModelReader | None, layout: list[TensorInfo],
           clip_norm: float | None, bounds: dict[str, Any]) -> list[float] | None:
    """Each update's clip factor under ``clip_norm`` (None: no clipping), recorded in
    ``bounds``."""
    if clip_norm is None:
        return None
    if previous is None:
        raise InvalidInput("clip_norm needs the global the round started from.")
    clips = clip_factors([delta_norm(u.reader, previous, layout) for u in active], clip_norm)
    bounds["clip_norm"] = clip_norm
    bounds["clip_factors"] = {u.site: f for u, f in zip(active, clips, strict=True)}
    return clips


def run_strategy(
    name: str,
    updates: Sequence[Path],
    previous_global_dir: Path | None,
    out_dir: Path,
    *,
    weighting: Weighting | Mapping[str, float] = "samples",
    weights: Sequence[float] | None = None,
    params: Mapping[str, float] | None = None,
    run_id: str | None = None,
    round: int | None = None,
    parent_digest: str | None = None,
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    max_shard_size: int | str | None = None,
    clip_norm: float | None = None,
    max_weight_share: float | None = None,
    decoding: Decoding | None = None,
) -> Manifest:
    """Aggregate ``updates`` with strategy ``name`` into a global checkpoint at ``out_dir``.

    ``previous_global_dir`` (the global the round started from) is required by the
    strategies that step from it (server optimizers; those with server state read it from
    there and write it beside the new global), and by ``clip_norm``. ``params`` overrides
    the strategy's defaults; ``progress(done, total)`` is called after each tensor;
    ``max_shard_size`` splits a larger model into Hugging Face shards (server state stays
    one file per buffer);
    ``clip_norm`` and ``max_weight_share`` bound one site's influence on the averaging
    strategies (:mod:`xffl.aggregator.robust`); ``decoding`` reads encoded updates (deltas,
    narrower dtypes) as the weights they stand for. The global's config file is
    ``previous_global_dir``'s bytes (:func:`xffl.aggregator.inputs.own_config`), never an
    update's. Other arguments are those of
    :func:`xffl.aggregator.fedavg.aggregate`; plain "fedavg" is that function. Inputs are not
    verified here: run :func:`xffl.aggregator.verify.select_updates` first.
    """
    strategy = get(name)
    p = resolve_params(name, params)
    bounded = clip_norm is not None or max_weight_share is not None
    if bounded and strategy.robust:
        raise InvalidInput(f"{name} bounds a minority's influence by its own rule; clip_norm "
                           "and max_weight_share apply to the averaging strategies only.")
    config = None if previous_global_dir is None else own_config(Path(previous_global_dir))
    if name == "fedavg" and not bounded:
        manifest = aggregate(
            updates,
            out_dir,
            weights,
            weighting=weighting,
            run_id=run_id,
            round=round,
            parent_digest=parent_digest,
            metadata=metadata,
            extra={"params": p},
            max_shard_size=max_shard_size,
            decoding=decoding,
            config=config,
        )
        if progress is not None:
            progress(len(manifest.tensors), len(manifest.tensors))
        return manifest
    with prepared(updates, decoding, weights, weighting, run_id, round, parent_digest,
                  config) as (ups, prep):
        max_bytes = parse_size(max_shard_size)
        active = [u for u in ups if u.weight > 0]
        strategy.check_count(p, len(active))
        bounds = _cap_shares(active, prep.sites, max_weight_share)
        with ExitStack() as stack:
            prev = None if previous_global_dir is None else Path(previous_global_dir)
            prev_model, prev_state, loaded = _open_previous(strategy, prev, prep.layout, stack)
            clips = _clips(active, prev_model, prep.layout, clip_norm, bounds)

            def write(tmp: Path, model_file: str) -> dict[str, str]:
                return _write(strategy, p, active, prep.layout, tmp, (prev_model, prev_state),
                              {"format": "pt", **(metadata or {})}, progress, max_bytes, clips,
                              model_file)

            extra = {
                "aggregation": name,
                "params": p,
                "weighting": "unweighted" if strategy.robust else prep.label,
                "sites": prep.sites,
                **({"bounds": bounds} if bounds else {}),
                "server_state": {
                    "files": [state_file(b) for b in strategy.state],
                    "loaded_from": str(prev) if loaded else None,
                },
            }
            return write_global(Path(out_dir), ups, prep, extra, write)
