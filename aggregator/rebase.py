"""A late update's change, moved onto the current global: ``w + s (u - w0)``, tensor by tensor.

An update ``u`` trained from an older global ``w0`` (a job that was still queued or running
at its round's deadline, admitted rounds later) is applied to the current global ``w`` as
its change ``u - w0`` scaled by its staleness factor ``s``. Written as an ordinary update of
the current round, any strategy then takes it like the others: with FedAvg's weights ``m_i``
the round's global is ``w + sum_i m_i s_i (u_i - w0_i) / sum_i m_i`` (``s_i = 1``,
``w0_i = w`` for the updates that are on time). Computed in float64 slice by slice and
rounded once to each tensor's dtype; the tensors' names, dtypes and shapes are the current
global's (admission checked the update's against its own global's, which has the same).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from xffl.aggregator.dtypes import decode, encode, storage_dtype
from xffl.aggregator.exchange import Manifest, finalize_manifest, read_manifest, staged_dir
from xffl.aggregator.kinds import kind_of
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import open_model

SLICE = 1 << 20  # elements per slice


def rebase(update: Path, started: Path, current: Path, factor: float, out: Path,
           rnd: int) -> Manifest:
    """Write ``current + factor * (update - started)`` at ``out`` as ``update``'s site's
    update of round ``rnd`` from ``current`` (its manifest's counts and metrics kept)."""
    src = read_manifest(update)
    base = read_manifest(current)
    kind = kind_of(current)
    entries = [(t.name, t.dtype, t.shape) for t in base.tensors]
    with staged_dir(out) as tmp, open_model(update) as u, open_model(started) as w0, \
            open_model(current) as w:
        with ShardedWriter(tmp, entries, {"format": "pt"}, single_file=kind.tensor_file) \
                as writer:
            for name, dtype, shape in entries:
                total = math.prod(shape)
                for lo in range(0, max(1, total), SLICE):  # an empty tensor: one empty slice
                    hi = min(total, lo + SLICE)
                    acc = decode(u.raw(name, lo, hi), dtype) - decode(w0.raw(name, lo, hi),
                                                                       dtype)
                    acc *= factor
                    acc += decode(w.raw(name, lo, hi), dtype)
                    chunk = np.empty(hi - lo, dtype=storage_dtype(dtype))
                    encode(acc, dtype, chunk, np.empty(hi - lo, dtype=np.float32))
                    writer.write_chunk(name, chunk)
        config = current / kind.config_file
        if config.is_file():
            (tmp / kind.config_file).write_bytes(config.read_bytes())
        manifest = Manifest(kind="update", run_id=base.run_id, round=rnd, site=src.site,
                            num_samples=src.num_samples, num_tokens=src.num_tokens,
                            metrics=dict(src.metrics), parent=base.digest(),
                            extra={"rebased_from": src.digest(), "started_round": src.round,
                                   "staleness_weight": factor})
        return finalize_manifest(tmp, manifest, checksums=writer.checksums)
