"""A running FedAvg: updates folded in one at a time, memory independent of their number.

:class:`RunningAggregate` keeps, for every tensor of the model, one float64 accumulator of
``sum_i w_i * x_i`` and, for the whole model, the scalar ``sum_i w_i``; each update is read
tensor by tensor, block by block (safetensors only, nothing unpickled), multiplied by its
weight and added, so it can be deleted right after :meth:`RunningAggregate.add` returns.
Memory is one float64 copy of the model plus a few cache-sized blocks, whatever the number
of updates (FedML Parrot's way of simulating many clients). :meth:`RunningAggregate.write`
divides by the total weight and casts to the model's dtypes exactly like
:func:`xffl.aggregator.fedavg.aggregate` does; only the order of the float64 additions
differs (arrival order instead of site order), so the two agree to within one rounding of
the stored dtype. The manifest's metrics are the weighted means of the updates' metrics,
as fedavg writes them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any, Literal

import numpy as np

from xffl.aggregator.decode import DecodedReader, Decoding
from xffl.aggregator.dtypes import STORAGE_DTYPES, Array, bf16_bits_to_f32, encode
from xffl.aggregator.exchange import (
    Manifest,
    TensorInfo,
    finalize_manifest,
    index_of,
    read_manifest,
    staged_dir,
)
from xffl.aggregator.fedavg import BLOCK_ELEMENTS
from xffl.aggregator.inputs import canonical_config, read_config, same_config
from xffl.aggregator.kinds import WHOLE_MODEL, kind_of
from xffl.aggregator.metrics import SITE_ONLY_METRICS
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import TensorReader, open_model
from xffl.aggregator.verify import layout_difference
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.core.sizes import parse_size


class RunningAggregate:
    """sum_i w_i x_i per tensor (float64) and sum_i w_i, folded one update at a time."""

    def __init__(self, layout: Sequence[TensorInfo], config: bytes | None = None) -> None:
        """Zeroed accumulators for the tensors of ``layout`` (the global model's index);
        ``config``: the coordinator's config bytes the result is written with (the updates'
        must equal them as JSON; without it, its own serialisation of their shared value)."""
        self.layout = sorted(layout, key=lambda t: t.name)
        #: one flat float64 accumulator per tensor: sum_i w_i * x_i
        self.sums: dict[str, Array] = {
            t.name: np.zeros(math.prod(t.shape), dtype=np.float64) for t in self.layout
        }
        self.total_weight = 0.0
        self.count = 0
        self.num_samples = 0
        self.num_tokens = 0
        self.config: bytes | None = config  # what the result's config file holds
        self._own = config is not None
        self.kind = WHOLE_MODEL  # of the updates folded: whole models or LoRA adapters
        self._config_value: Any = None if config is None else json.loads(config)
        self._seen: tuple[bytes | None, Any] | None = None  # the first update's config
        self._metric_wsum: dict[str, float] = {}
        self._metric_weight: dict[str, float] = {}
        self._metric_sum: dict[str, float] = {}
        self._metric_count: dict[str, int] = {}
        self._broken: str | None = None
        self._tmp = np.empty(BLOCK_ELEMENTS, dtype=np.float64)
        self._f32 = np.empty(BLOCK_ELEMENTS, dtype=np.float32)
        self._raw: dict[str, Array] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the accumulators and scratch blocks (constant after construction)."""
        scratch = self._tmp.nbytes + self._f32.nbytes + sum(b.nbytes for b in self._raw.values())
        return sum(a.nbytes for a in self.sums.values()) + scratch

    def _block(self, dtype: str) -> Array:
        if dtype not in self._raw:  # one reused read buffer per storage dtype
            self._raw[dtype] = np.empty(BLOCK_ELEMENTS, dtype=STORAGE_DTYPES[dtype])
        return self._raw[dtype]

    def add(self, directory: Path, weight: float, manifest: Manifest | None = None,
            decoding: Decoding | None = None) -> None:
        """Fold the update in ``directory`` with raw ``weight`` into the running sums.

        The update must already be verified (:func:`xffl.aggregator.verify.check_update`);
        here only its tensor layout and config.json are checked against the others.
        ``decoding``: the update is encoded (a delta, a narrower dtype) against that global.
        """
        if self._broken:
            raise CheckpointError(f"the running aggregate is unusable: {self._broken}")
        directory = Path(directory)
        manifest = manifest if manifest is not None else read_manifest(directory)
        label = manifest.site or directory.name
        if not math.isfinite(weight) or weight < 0:
            raise InvalidInput(f"weight of site '{label}' is {weight}; weights must be >= 0.")
        self._check_config(directory, label)
        model = open_model(directory)
        reader: TensorReader = model if decoding is None else DecodedReader(
            model, open_model(decoding.reference), delta=decoding.delta, codec=decoding.codec)
        with closing(reader):
            diff = layout_difference(index_of(reader), self.layout)
            if diff:
                raise CheckpointError(f"update from site '{label}' ({directory}): {diff}.")
            if weight > 0:
                try:
                    for t in self.layout:
                        self._fold(reader, t, weight)
                except BaseException as exc:
                    self._broken = f"folding site '{label}' failed halfway ({exc})"
                    raise
        self.total_weight += weight
        self.count += 1
        self.num_samples += manifest.num_samples
        self.num_tokens += manifest.num_tokens
        for key, value in manifest.metrics.items():
            if key in SITE_ONLY_METRICS:  # as weighted_metrics: not the aggregate's
                continue
            self._metric_wsum[key] = self._metric_wsum.get(key, 0.0) + weight * value
            self._metric_weight[key] = self._metric_weight.get(key, 0.0) + weight
            self._metric_sum[key] = self._metric_sum.get(key, 0.0) + value
            self._metric_count[key] = self._metric_count.get(key, 0) + 1

    def _fold(self, reader: TensorReader, t: TensorInfo, weight: float) -> None:
        """acc += weight * x for one tensor, block by block."""
        acc = self.sums[t.name]
        buf = self._block(t.dtype)
        for lo in range(0, acc.shape[0], BLOCK_ELEMENTS):
            hi = min(lo + BLOCK_ELEMENTS, acc.shape[0])
            m = hi - lo
            x: Array = reader.read_into(t.name, lo, buf[:m])
            if t.dtype == "BF16":
                x = bf16_bits_to_f32(x, out=self._f32[:m])
            tmp = self._tmp[:m]
            np.copyto(tmp, x, casting="unsafe")  # exact: every stored type fits float64
            np.multiply(tmp, weight, out=tmp)
            np.add(acc[lo:hi], tmp, out=acc[lo:hi])

    def _check_config(self, directory: Path, label: str) -> None:
        config = read_config(directory, label)
        kind = kind_of(directory)
        if self.count and kind != self.kind:
            raise CheckpointError(f"site '{label}' sent another kind of update (a model or a "
                                  "LoRA adapter) than the sites before it.")
        self.kind = kind
        if self._own and config[0] is not None and config[1] != self._config_value:
            raise CheckpointError(f"{kind.config_file} of site '{label}' differs from "
                                  "the global model's.")
        if self._seen is None:
            self._seen = config
            if not self._own:  # never the update's bytes: the coordinator's serialisation
                self._config_value = config[1]
                self.config = None if config[0] is None else canonical_config(config[1])
        elif not same_config(config, self._seen):
            raise CheckpointError(f"{kind.config_file} of site '{label}' differs from "
                                  "that of the updates folded before it.")

    def metrics(self) -> dict[str, float]:
        """Weighted mean of each metric over the updates that report it (as fedavg's)."""
        out: dict[str, float] = {}
        for key in sorted(self._metric_sum):
            if self._metric_weight[key] > 0:
                out[key] = self._metric_wsum[key] / self._metric_weight[key]
            else:
                out[key] = self._metric_sum[key] / self._metric_count[key]
        return out

    def write(
        self,
        out_dir: Path,
        *,
        run_id: str,
        round: int,
        parent: str | None,
        kind: Literal["global", "update"] = "global",
        site: str | None = None,
        extra: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
        max_shard_size: int | str | None = None,
    ) -> Manifest:
        """Write sum_i w_i x_i / sum_i w_i as a checkpoint at ``out_dir`` (atomically)."""
        if self._broken:
            raise CheckpointError(f"the running aggregate is unusable: {self._broken}")
        if self.count == 0:
            raise InvalidInput("no updates to aggregate.")
        if self.total_weight <= 0:
            raise InvalidInput("all weights are zero; the manifests may lack sample/token "
                               "counts (try weighting: uniform).")
        entries = [(t.name, t.dtype, t.shape) for t in self.layout]
        out = {d: np.empty(BLOCK_ELEMENTS, dtype=STORAGE_DTYPES[d]) for d in
               {t.dtype for t in self.layout}}
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, entries, {"format": "pt", **(metadata or {})},
                               max_shard_bytes=parse_size(max_shard_size),
                               single_file=self.kind.tensor_file) as writer:
                for t in self.layout:
                    acc = self.sums[t.name]
                    for lo in range(0, max(1, acc.shape[0]), BLOCK_ELEMENTS):
                        hi = min(lo + BLOCK_ELEMENTS, acc.shape[0])
                        block = self._tmp[: hi - lo]
                        np.divide(acc[lo:hi], self.total_weight, out=block)
                        dst = out[t.dtype][: hi - lo]
                        encode(block, t.dtype, dst, self._f32[: hi - lo])
                        writer.write_chunk(t.name, dst)
            if self.config is not None:
                (tmp / self.kind.config_file).write_bytes(self.config)
            manifest = Manifest(
                kind=kind, run_id=run_id, round=round, site=site, parent=parent,
                num_samples=self.num_samples, num_tokens=self.num_tokens,
                metrics=self.metrics(),
                extra={"aggregation": "fedavg", "running": True, "updates": self.count,
                       **(extra or {})},
            )
            return finalize_manifest(tmp, manifest, checksums=writer.checksums)
