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
(at most SLICE_ELEMENTS, at least MIN_SLICE_ELEMENTS elements per update).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from xffl.aggregator.exchange import (
    CONFIG_FILE,
    MODEL_FILE,
    Manifest,
    TensorInfo,
    finalize_manifest,
    read_manifest,
    staged_dir,
)
from xffl.aggregator.safetensors_io import (
    FLOAT_DTYPES,
    STORAGE_DTYPES,
    Array,
    SafetensorsReader,
    SafetensorsWriter,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
)
from xffl.aggregator.verify import canonical_key, index_of, layout_difference
from xffl.core.errors import CheckpointError, InvalidInput

Weighting = Literal["samples", "tokens", "uniform"]
WEIGHTINGS: tuple[str, ...] = ("samples", "tokens", "uniform")

SLICE_ELEMENTS = 1 << 21  # most elements per slice (8 MiB of fp32 per update)
READ_BUDGET_ELEMENTS = 1 << 23  # elements of one slice of every update together (32 MiB fp32)
MIN_SLICE_ELEMENTS = 1 << 16  # fewest elements per slice, however many updates
BLOCK_ELEMENTS = 1 << 17  # elements per accumulation block (fits in L2/L3)
FLUSH_BYTES = 64 << 20  # start writeback of the output every this many bytes


@dataclass
class _Update:
    """One opened input, in canonical order."""

    path: Path
    manifest: Manifest
    site: str
    digest: str
    position: int  # index in the caller's list
    reader: SafetensorsReader
    weight: float = 0.0


def _open_updates(paths: Sequence[Path]) -> list[_Update]:
    """Read manifests, open model files, sort canonically; close everything on failure."""
    opened: list[_Update] = []
    try:
        for pos, raw in enumerate(paths):
            path = Path(raw)
            manifest = read_manifest(path)
            site, digest = canonical_key(path, manifest)
            try:
                reader = SafetensorsReader(path / MODEL_FILE)
            except (CheckpointError, OSError) as exc:
                raise CheckpointError(f"update from site '{site}' ({path}): {exc}") from exc
            opened.append(_Update(path, manifest, site, digest, pos, reader))
    except BaseException:
        for u in opened:
            u.reader.close()
        raise
    opened.sort(key=lambda u: (u.site, u.digest))
    return opened


def _assign_weights(
    ups: list[_Update], weights: Sequence[float] | None, weighting: Weighting | Mapping[str, float]
) -> str:
    """Set each update's raw weight; return a label of the weighting used."""
    if weights is not None:
        if len(weights) != len(ups):
            raise InvalidInput(f"{len(weights)} weights given for {len(ups)} updates.")
        for u in ups:
            u.weight = float(weights[u.position])
        label = "explicit"
    elif isinstance(weighting, Mapping):
        missing = sorted(u.site for u in ups if u.site not in weighting)
        if missing:
            raise InvalidInput(f"no weight given for site(s) {', '.join(missing)}.")
        for u in ups:
            u.weight = float(weighting[u.site])
        label = "explicit"
    elif weighting in WEIGHTINGS:
        for u in ups:
            u.weight = {
                "samples": float(u.manifest.num_samples),
                "tokens": float(u.manifest.num_tokens),
                "uniform": 1.0,
            }[weighting]
        label = weighting
    else:
        raise InvalidInput(f"unknown weighting {weighting!r}; use one of {', '.join(WEIGHTINGS)}.")
    for u in ups:
        if not math.isfinite(u.weight) or u.weight < 0:
            raise InvalidInput(f"weight of site '{u.site}' is {u.weight}; weights must be >= 0.")
    if sum(u.weight for u in ups) <= 0:
        raise InvalidInput(
            f"all weights are zero under '{label}' weighting; the manifests may lack "
            "sample/token counts (try --weighting uniform)."
        )
    return label


def _agree(ups: list[_Update], what: str, field: str, given: Any) -> Any:
    """The value of a manifest field that every update shares (``given``, else the first's)."""
    want = given if given is not None else getattr(ups[0].manifest, field)
    for u in ups:
        got = getattr(u.manifest, field)
        if got != want:
            raise CheckpointError(
                f"update from site '{u.site}' ({u.path}) has {what} {got!r}, expected {want!r}."
            )
    return want


def _common_layout(ups: list[_Update]) -> list[TensorInfo]:
    """The tensor index all updates share (raises naming the first site that differs)."""
    ref = index_of(ups[0].reader)
    for u in ups[1:]:
        diff = layout_difference(index_of(u.reader), ref, f"site '{ups[0].site}'")
        if diff:
            raise CheckpointError(f"update from site '{u.site}' ({u.path}): {diff}.")
    return ref


def _common_config(ups: list[_Update]) -> bytes | None:
    """config.json of the first update, after checking that all updates carry the same one."""
    first: bytes | None = None
    parsed: Any = None
    for i, u in enumerate(ups):
        path = u.path / CONFIG_FILE
        data = path.read_bytes() if path.is_file() else None
        try:
            value = None if data is None else json.loads(data)
        except ValueError as exc:
            raise CheckpointError(
                f"update from site '{u.site}' ({u.path}): unreadable {CONFIG_FILE}."
            ) from exc
        if i == 0:
            first, parsed = data, value
        elif (data is None) != (first is None) or value != parsed:
            raise CheckpointError(
                f"{CONFIG_FILE} of site '{u.site}' differs from that of site '{ups[0].site}'."
            )
    return first


def _store(acc: Array, dtype: str, out: Array, scratch: Array) -> None:
    """Cast a float64 block into ``out`` (storage dtype), rounding like torch's .to(dtype)."""
    if dtype == "BF16":
        np.copyto(scratch, acc, casting="same_kind")
        f32_to_bf16_bits(scratch, out=out)
    elif dtype == "F16":
        np.copyto(scratch, acc, casting="same_kind")
        np.copyto(out, scratch, casting="same_kind")
    elif dtype in FLOAT_DTYPES:
        np.copyto(out, acc, casting="same_kind")
    else:  # integer and bool tensors: weighted mean rounded half to even
        np.rint(acc, out=acc)
        np.copyto(out, acc, casting="unsafe")


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
            _store(acc, dtype, out[lo:hi], f32)


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
    ups: list[_Update], layout: list[TensorInfo], path: Path, metadata: Mapping[str, str]
) -> str:
    """Stream the weighted average of all tensors into ``path``; return the file's sha256.

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
        SafetensorsWriter(path, entries, metadata, flush_every=FLUSH_BYTES) as writer,
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
    return writer.sha256


def _weighted_metrics(ups: list[_Update]) -> dict[str, float]:
    """Weighted mean of each metric over the updates that report it."""
    out: dict[str, float] = {}
    for key in sorted({k for u in ups for k in u.manifest.metrics}):
        have = [u for u in ups if key in u.manifest.metrics]
        wsum = math.fsum(u.weight for u in have)
        if wsum > 0:
            out[key] = math.fsum(u.weight * u.manifest.metrics[key] for u in have) / wsum
        else:
            out[key] = math.fsum(u.manifest.metrics[key] for u in have) / len(have)
    return out


def _prepare(
    ups: list[_Update],
    weights: Sequence[float] | None,
    weighting: Weighting | Mapping[str, float],
    run_id: str | None,
    round: int | None,
    parent_digest: str | None,
) -> tuple[str, Any, Any, Any, list[TensorInfo], bytes | None, dict[str, Any]]:
    """Checks and derivations every strategy starts with.

    One update per site, their weights, the run/round/parent they agree on, the common
    tensor layout and config, and the per-site summary for the manifest. Returns
    (weighting label, run id, round, parent, layout, config bytes, sites).
    """
    dup = {u.site for u in ups if sum(v.site == u.site for v in ups) > 1}
    if dup:
        raise CheckpointError(f"more than one update from site(s) {', '.join(sorted(dup))}.")
    label = _assign_weights(ups, weights, weighting)
    run = _agree(ups, "run id", "run_id", run_id)
    rnd = _agree(ups, "round", "round", round)
    parent = _agree(ups, "parent", "parent", parent_digest)
    layout = _common_layout(ups)
    config = _common_config(ups)
    total = math.fsum(u.weight for u in ups)
    sites = {
        u.site: {
            "num_samples": u.manifest.num_samples,
            "num_tokens": u.manifest.num_tokens,
            "metrics": dict(u.manifest.metrics),
            "weight": u.weight / total,
            "digest": u.digest,
        }
        for u in ups
    }
    return label, run, rnd, parent, layout, config, sites


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
) -> Manifest:
    """Write the weighted FedAvg of ``updates`` as a global checkpoint at ``out_dir``.

    ``weights`` (one per update, in the order given) overrides ``weighting``: "samples",
    "tokens", "uniform" or a {site: weight} mapping. ``run_id``, ``round`` and
    ``parent_digest`` default to the value all updates share; an update that disagrees
    with them raises CheckpointError. The output appears atomically; on failure
    ``out_dir`` keeps its previous content. Inputs are not verified here: run
    :func:`xffl.aggregator.verify.select_updates` first.
    """
    if not updates:
        raise InvalidInput("no updates to aggregate.")
    ups = _open_updates(updates)
    try:
        label, run, rnd, parent, layout, config, sites = _prepare(
            ups, weights, weighting, run_id, round, parent_digest
        )
        st_meta = {"format": "pt", **(metadata or {})}
        with staged_dir(Path(out_dir)) as tmp:
            sha = _write_average(ups, layout, tmp / MODEL_FILE, st_meta)
            if config is not None:
                (tmp / CONFIG_FILE).write_bytes(config)
            manifest = Manifest(
                kind="global",
                run_id=run,
                round=rnd,
                parent=parent,
                num_samples=sum(u.manifest.num_samples for u in ups),
                num_tokens=sum(u.manifest.num_tokens for u in ups),
                metrics=_weighted_metrics(ups),
                extra={
                    "aggregation": "fedavg",
                    "weighting": label,
                    "sites": sites,
                    **(extra or {}),
                },
            )
            return finalize_manifest(tmp, manifest, checksums={MODEL_FILE: sha})
    finally:
        for u in ups:
            u.reader.close()
