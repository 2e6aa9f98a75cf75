"""Stream a model into ``model.safetensors``, or Hugging Face shards plus their index json.

Shards are planned up front from the declared tensors (:func:`xffl.aggregator.shards.
plan_shards`, huggingface_hub's rule), so every shard is written header first by a
:class:`SafetensorsWriter` while the tensors arrive in declared order, slice by slice.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from xffl.aggregator.safetensors_io import (
    AbortingWriter,
    Array,
    SafetensorsWriter,
    storage_dtype,
)
from xffl.aggregator.shards import INDEX_FILE, MODEL_FILE, plan_shards, shard_name
from xffl.core.errors import CheckpointError

Entries = Sequence[tuple[str, str, Sequence[int]]]


class ShardedWriter(AbortingWriter):
    """Stream a model into ``model.safetensors``, or HF shards plus index json, header first.

    Same calls as :class:`SafetensorsWriter`: tensors in declared order, whole or in flat
    pieces. Each shard file is created when its first tensor starts and closed after its
    last; the index json is written by :meth:`close`.
    """

    def __init__(
        self,
        directory: Path,
        entries: Entries,
        metadata: Mapping[str, str] | None = None,
        *,
        max_shard_bytes: int | None = None,
        flush_every: int = 0,
        single_file: str = MODEL_FILE,
    ) -> None:
        """Plan the shards of ``entries`` (model.safetensors alone if one shard suffices).

        ``single_file`` names the one file of an unsharded model; an adapter's
        (``adapter_model.safetensors``) is never split.
        """
        if single_file != MODEL_FILE:
            max_shard_bytes = None
        self.directory = Path(directory)
        self._entries = [(n, d, tuple(int(x) for x in s)) for n, d, s in entries]
        seen: set[str] = set()
        for name, _, _ in self._entries:
            if name in seen:
                raise CheckpointError(f"duplicate tensor name {name!r}.")
            seen.add(name)
        self._nbytes = [math.prod(s) * storage_dtype(d).itemsize for _, d, s in self._entries]
        plan = plan_shards(self._nbytes, max_shard_bytes)
        count = len(plan)
        #: the model files, in shard order (``model.safetensors`` when not sharded).
        self.shard_files = [single_file] if count == 1 else [
            shard_name(i, count) for i in range(1, count + 1)
        ]
        self._shard_of = {i: k for k, members in enumerate(plan) for i in members}
        self._plan = plan
        self._metadata = dict(metadata or {})
        self._flush_every = flush_every
        self._open: dict[int, SafetensorsWriter] = {}
        self._sums: dict[str, str] = {}
        self._index = 0  # next entry to write
        self._done = 0  # elements of that entry already written
        self._closed = False
        if count == 1:  # exactly today's single-file writer, created up front
            self._writer(0)

    @property
    def sharded(self) -> bool:
        """Whether the model is split into shards with an index json."""
        return len(self.shard_files) > 1

    def _writer(self, shard: int) -> SafetensorsWriter:
        if shard not in self._open:
            self._open[shard] = SafetensorsWriter(
                self.directory / self.shard_files[shard],
                [self._entries[i] for i in self._plan[shard]],
                self._metadata,
                flush_every=self._flush_every,
            )
        return self._open[shard]

    def _current(self, name: str) -> SafetensorsWriter:
        if self._closed:
            raise CheckpointError(f"{self.directory.name}: the writer is closed.")
        if self._index >= len(self._entries):
            raise CheckpointError(f"tensor {name!r} is past the last declared tensor.")
        expected = self._entries[self._index][0]
        if expected != name:
            raise CheckpointError(
                f"expected tensor {expected!r} next (declared order), got {name!r}."
            )
        return self._writer(self._shard_of[self._index])

    def _advance(self, elements: int) -> None:
        i = self._index
        self._done += elements
        if self._done < math.prod(self._entries[i][2]):
            return
        self._index, self._done = i + 1, 0
        shard = self._shard_of[i]
        if self._plan[shard][-1] == i:  # the shard's last tensor: finish its file
            writer = self._open.pop(shard)
            writer.close()
            self._sums[self.shard_files[shard]] = writer.sha256

    def write(self, name: str, array: Array) -> None:
        """Write one whole tensor; its shape must be the declared one."""
        writer = self._current(name)
        writer.write(name, array)
        self._advance(int(np.size(array)))

    def write_chunk(self, name: str, array: Array) -> None:
        """Append the next flat piece of tensor ``name`` (converted to its declared dtype)."""
        writer = self._current(name)
        writer.write_chunk(name, array)
        self._advance(int(np.size(array)))

    def index_json(self) -> bytes:
        """The index file's content, as transformers' save_pretrained formats it."""
        index = {
            "metadata": {"total_size": sum(self._nbytes)},
            "weight_map": {
                n: self.shard_files[self._shard_of[i]] for i, (n, _, _) in enumerate(self._entries)
            },
        }
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()

    @property
    def checksums(self) -> dict[str, str]:
        """sha256 of every file written (shards and index), available after close."""
        if not self._closed or len(self._sums) < len(self.shard_files):
            raise CheckpointError(f"{self.directory.name}: checksums are known after close().")
        return dict(self._sums)

    def close(self) -> None:
        """Check that every declared tensor was written in full, then finish every file."""
        if self._closed:
            return
        if self._index < len(self._entries):
            missing = self._entries[self._index][0]
            self.abort()
            raise CheckpointError(f"{self.directory.name}: tensor {missing!r} was not written.")
        for shard in sorted(self._open):  # only a model without tensors leaves one open
            writer = self._open.pop(shard)
            writer.close()
            self._sums[self.shard_files[shard]] = writer.sha256
        if self.sharded:
            data = self.index_json()
            (self.directory / INDEX_FILE).write_bytes(data)
            self._sums[INDEX_FILE] = hashlib.sha256(data).hexdigest()
        self._closed = True

    def abort(self) -> None:
        """Close and delete every file written so far."""
        self._closed = True
        for writer in self._open.values():
            writer.abort()
        self._open.clear()
        for file in [*self.shard_files, INDEX_FILE] if self.sharded else []:
            (self.directory / file).unlink(missing_ok=True)
