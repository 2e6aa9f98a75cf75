"""Streaming weighted FedAvg: one tensor slice of every update in memory at a time.

For every tensor (sorted by name) and every slice of it, a reader thread reads the slices
of all updates into reused buffers (positional reads, prefetched one slice ahead: on small
VMs they cost less CPU than faulting in memmapped pages); the caller's thread accumulates
``sum_i w_i * x_i`` in float64 over cache-sized blocks, divides by ``sum_i w_i`` and casts
to the model's dtype; a writer thread hashes and writes the result. Updates are visited in
a canonical order (site name, then digest), so the result is bitwise independent of the
order passed in. Memory stays near two slices per update plus two output slices, whatever
the model size and the number of updates: the slices of all updates together hold
READ_BUDGET_ELEMENTS elements (32 MiB of fp32), so a slice shrinks as updates are added
(at most SLICE_ELEMENTS, at least MIN_SLICE_ELEMENTS elements per update). The output
is ``model.safetensors``, or Hugging Face shards with an index json when it exceeds
``max_shard_size`` (:mod:`xffl.aggregator.shard_writer`); inputs may be either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.decode import Decoding
from xffl.aggregator.dtypes import encode
from xffl.aggregator.exchange import Manifest, TensorInfo
from xffl.aggregator.inputs import (
    Update,
    prepared,
    write_global,
)
from xffl.aggregator.strategy_catalog import Weighting
from xffl.aggregator.safetensors_io import (
    STORAGE_DTYPES,
    Array,
    bf16_bits_to_f32,
)
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import MODEL_FILE
from xffl.core.sizes import parse_size

SLICE_ELEMENTS = 1 << 21  # most elements per slice (8 MiB of fp32 per update)
READ_BUDGET_ELEMENTS = 1 << 23  # elements of one slice of every update together (32 MiB fp32)
MIN_SLICE_ELEMENTS = 1 << 16  # fewest elements per slice, however many updates
BLOCK_ELEMENTS = 1 << 17  # elements per accumulation block (fits in L2/L3)
FLUSH_BYTES = 64 << 20  # start writeback of the output every this many bytes


class _Averager:
    """Reusable cache-sized buffers for averaging one slice of every update."""

    def __init__(self) -> None:
        self.acc = np.empty(BLOCK_ELEMENTS, dtype=np.float64)
        self.tmp = np.empty(BLOCK_ELEMENTS, dtype=np.float64)
        self.f32 = np.empty(BLOCK_ELEMENTS, dtype=np.float32)

    def average(
        self, raws: Sequence[Array], weights: Sequence[float], total: float, dtype: str, out: Array
    ) -> None:
        """out[:] = sum_i weights[i] * raws[i] / total, block by block, in float64."""
        n = out.shape[0]
        for lo in range(0, n, BLOCK_ELEMENTS):
            hi = min(lo + BLOCK_ELEMENTS, n)
            m = hi - lo
            acc, tmp, f32 = self.acc[:m], self.tmp[:m], self.f32[:m]
            for i, (raw, w) in enumerate(zip(raws, weights, strict=True)):
                x = raw[lo:hi]
                if dtype == "BF16":
                    x = bf16_bits_to_f32(x, out=f32)
                dst = acc if i == 0 else tmp
                np.copyto(dst, x, casting="unsafe")  # exact: every stored type fits float64
                np.multiply(dst, w, out=dst)
                if i:
                    np.add(acc, tmp, out=acc)
            np.divide(acc, total, out=acc)
            encode(acc, dtype, out[lo:hi], f32)


def slice_elements(count: int) -> int:
    """Elements per slice when reading ``count`` updates: a fixed total, split between them.

    Keeps the input buffers (two slots of ``count`` slices) the same size whatever the number
    of updates, down to MIN_SLICE_ELEMENTS per update; never more than SLICE_ELEMENTS. The
    result does not depend on it: every element is averaged on its own.
    """
    share = READ_BUDGET_ELEMENTS // max(1, count)
    share -= share % MIN_SLICE_ELEMENTS
    return max(1, min(SLICE_ELEMENTS, max(MIN_SLICE_ELEMENTS, share)))


class _SliceBuffers:
    """Reusable slice-sized buffers: ``count`` per (dtype, slot), two slots to alternate."""

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self._bufs: dict[tuple[str, int], list[Array]] = {}

    def get(self, dtype: str, slot: int) -> list[Array]:
        """The buffers of one slot for one dtype, allocated on first use."""
        key = (dtype, slot)
        if key not in self._bufs:
            dt = STORAGE_DTYPES[dtype]
            self._bufs[key] = [np.empty(self.size, dtype=dt) for _ in range(self.count)]
        return self._bufs[key]


def _write_average(
    ups: list[Update],
    layout: list[TensorInfo],
    directory: Path,
    metadata: Mapping[str, str],
    max_shard_bytes: int | None = None,
    single_file: str = MODEL_FILE,
) -> dict[str, str]:
    """Stream the weighted average of all tensors into ``directory``; return {file: sha256}.

    A three-stage pipeline over slices: a reader thread fills slice k+1 of every update
    while the caller's thread averages slice k and a writer thread hashes and writes k-1.
    """
    active = [u for u in ups if u.weight > 0]
    weights = [u.weight for u in active]
    total = math.fsum(weights)
    entries = [(t.name, t.dtype, t.shape) for t in layout]
    step = slice_elements(len(active))
    slices = [
        (t, lo, min(lo + step, math.prod(t.shape)))
        for t in layout
        for lo in range(0, max(1, math.prod(t.shape)), step)  # empty tensors: one
    ]
    averager = _Averager()
    inputs, outputs = _SliceBuffers(len(active), step), _SliceBuffers(1, step)

    def load(k: int) -> list[Array]:
        t, lo, hi = slices[k]
        if k + 1 < len(slices):  # let the kernel read the next slice while this one is copied
            nt, nlo, nhi = slices[k + 1]
            for u in active:
                u.reader.prefetch(nt.name, nlo, nhi)
        bufs = inputs.get(t.dtype, k % 2)
        return [
            u.reader.read_into(t.name, lo, buf[: hi - lo])
            for u, buf in zip(active, bufs, strict=True)
        ]

    writes: list[Future[None] | None] = [None, None]
    with (
        ShardedWriter(
            directory, entries, metadata, max_shard_bytes=max_shard_bytes, flush_every=FLUSH_BYTES,
            single_file=single_file,
        ) as writer,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="xffl-read") as read_pool,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="xffl-write") as write_pool,
    ):
        loading = read_pool.submit(load, 0)
        try:
            for k, (t, lo, hi) in enumerate(slices):
                raws = loading.result()
                if k + 1 < len(slices):
                    loading = read_pool.submit(load, k + 1)  # fills the other input slot
                slot = k % 2
                previous = writes[slot]
                if previous is not None:
                    previous.result()  # the writer is done with this output buffer
                out = outputs.get(t.dtype, slot)[0][: hi - lo]
                averager.average(raws, weights, total, t.dtype, out)
                writes[slot] = write_pool.submit(writer.write_chunk, t.name, out)
        except BaseException:
            in_flight: list[Future[Any]] = [f for f in (loading, *writes) if f is not None]
            wait(in_flight)
            raise
        for fut in writes:
            if fut is not None:
                fut.result()
    return writer.checksums


def aggregate(
    updates: Sequence[Path],
    out_dir: Path,
    weights: Sequence[float] | None = None,
    *,
    weighting: Weighting | Mapping[str, float] = "samples",
    run_id: str | None = None,
    round: int | None = None,
    parent_digest: str | None = None,
    metadata: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    decoding: Decoding | None = None,
    config: bytes | None = None,
) -> Manifest:
    """Write the weighted FedAvg of ``updates`` as a global checkpoint at ``out_dir``.

    ``weights`` (one per update, in the order given) overrides ``weighting``: "samples",
    "tokens", "uniform" or a {site: weight} mapping. ``run_id``, ``round`` and
    ``parent_digest`` default to the value all updates share; an update that disagrees
    with them raises CheckpointError. A model of more than ``max_shard_size`` (bytes or a
    string such as "5GB"; None: never) is written as Hugging Face shards with an index json.
    ``decoding``: the updates are encoded (deltas, narrower dtypes) against that global.
    ``config``: the coordinator's config bytes for the global (the updates' must equal them
    as JSON); without it, its own serialisation of the updates' shared config value.
    The output appears atomically; on failure
    ``out_dir`` keeps its previous content. Inputs are not verified here: run
    :func:`xffl.aggregator.verify.select_updates` first.
    """
    st_meta = {"format": "pt", **(metadata or {})}
    with prepared(updates, decoding, weights, weighting, run_id, round, parent_digest,
                  config) as (ups, prep):
        max_bytes = parse_size(max_shard_size)

        def write(tmp: Path, model_file: str) -> dict[str, str]:
            return _write_average(ups, prep.layout, tmp, st_meta, max_bytes, model_file)

        extra = {"aggregation": "fedavg", "weighting": prep.label, "sites": prep.sites,
                 **(extra or {})}
        return write_global(Path(out_dir), ups, prep, extra, write)
