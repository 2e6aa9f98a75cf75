"""Whole-model safetensors access: one ``model.safetensors``, or Hugging Face shards + index.

A model of more than ``max_shard_bytes`` of tensor data is written the way transformers'
``save_pretrained(max_shard_size=...)`` writes it (huggingface_hub's split rule):
``model-00001-of-00003.safetensors``, ... plus ``model.safetensors.index.json`` =
``{"metadata": {"total_size": BYTES}, "weight_map": {tensor: file}}``. :func:`open_model`
reads either layout through one reader, after checking the index against the shards;
:class:`xffl.aggregator.shard_writer.ShardedWriter` streams a model into either layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from xffl.aggregator.safetensors_io import (
    MAX_HEADER,
    Array,
    SafetensorsReader,
    TensorEntry,
    no_duplicate_keys,
)
from xffl.core.errors import CheckpointError

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 16 << 20
# a LoRA adapter is written as peft writes it: one file of adapter tensors, never sharded,
# beside adapter_config.json instead of config.json
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
CONFIG_FILE = "config.json"


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of shard ``index`` (1-based) of ``count``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Sequence[int], max_shard_bytes: int | None) -> list[list[int]]:
    """Group tensors (by position) into shards with huggingface_hub's rule.

    Tensors are taken in order and added to the current shard until the next one would push
    it over the limit; a tensor larger than the limit gets a shard of its own, placed before
    the shard being filled (as ``split_state_dict_into_shards_factory`` does).
    """
    if not max_shard_bytes:
        return [list(range(len(sizes)))]
    shards: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size > max_shard_bytes:
            shards.append([i])
            continue
        if filled + size > max_shard_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current or not shards:
        shards.append(current)
    return shards


def read_index(path: Path, limit: int = MAX_INDEX_BYTES) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json, checked for shape and plain names
    (more than ``limit`` bytes: refused unread)."""
    def bad(reason: str) -> CheckpointError:
        return CheckpointError(f"{INDEX_FILE}: {reason}.")

    if Path(path).stat().st_size > limit:  # read only what an index can need
        raise bad(f"more than {limit} bytes")
    try:
        index = json.loads(Path(path).read_bytes(), object_pairs_hook=no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"unreadable JSON ({exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise bad("no weight_map object")
    if not isinstance(index.get("metadata", {}), dict):
        raise bad("metadata is not an object")
    weight_map: dict[str, Any] = index["weight_map"]
    if not weight_map:
        raise bad("the weight_map lists no tensor")
    for name, file in weight_map.items():
        plain = isinstance(file, str) and Path(file).name == file
        if not plain or not file.endswith(".safetensors") or \
                file in (MODEL_FILE, INDEX_FILE, ADAPTER_FILE):
            raise bad(f"tensor {name!r} maps to {file!r}, not a shard file name")
    return dict(weight_map)


class TensorReader(Protocol):
    """What a strategy reads an update through: a :class:`ModelReader`, or a
    :class:`xffl.aggregator.decode.DecodedReader` over one."""

    entries: dict[str, TensorEntry]

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> Array:
        """Flat storage elements ``[start, stop)`` of a tensor."""

    def read_into(self, name: str, start: int, out: Array) -> Array:
        """Copy flat storage elements ``[start, start + out.size)`` of a tensor into ``out``."""

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Start reading elements ``[start, stop)`` ahead of use."""

    def close(self) -> None:
        """Release the files."""


class ModelReader:
    """All tensors of a checkpoint directory, read through one SafetensorsReader per file."""

    def __init__(
        self, directory: Path, shards: dict[str, SafetensorsReader], index_file: str | None
    ) -> None:
        """Wrap readers already opened and checked by :func:`open_model` (file -> reader)."""
        self.path = Path(directory)
        self.shards = shards
        self.index_file = index_file
        self._where = {n: r for r in shards.values() for n in r.entries}
        #: header entries of every tensor; offsets are within the tensor's own file.
        self.entries: dict[str, TensorEntry] = {
            n: r.entries[n] for r in shards.values() for n in r.entries
        }
        first = next(iter(shards.values()), None)
        self.metadata: dict[str, str] = dict(first.metadata) if first else {}

    @property
    def files(self) -> list[str]:
        """The files holding tensors (``model.safetensors`` or the shards), in name order."""
        return list(self.shards)

    def shard_of(self, name: str) -> SafetensorsReader:
        """The reader of the file that holds tensor ``name``."""
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.path.name}: no tensor named {name!r}.") from None

    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self.entries)

    def entry(self, name: str) -> TensorEntry:
        """The header entry of one tensor (offsets within its file)."""
        return self.shard_of(name).entry(name)

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> Array:
        """Flat storage elements ``[start, stop)`` of a tensor as a read-only memmap."""
        return self.shard_of(name).raw(name, start, stop)

    def read_into(self, name: str, start: int, out: Array) -> Array:
        """Copy flat storage elements ``[start, start + out.size)`` of a tensor into ``out``."""
        return self.shard_of(name).read_into(name, start, out)

    def read(self, name: str) -> Array:
        """One whole tensor, decoded (bf16 -> float32), in its shape."""
        return self.shard_of(name).read(name)

    def chunks(self, name: str, max_elements: int) -> Iterator[Array]:
        """A tensor's flat storage elements in memmapped pieces of at most max_elements."""
        return self.shard_of(name).chunks(name, max_elements)

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Ask the kernel to start reading elements ``[start, stop)`` of a tensor ahead of use."""
        self.shard_of(name).prefetch(name, start, stop)

    def close(self) -> None:
        """Close every file."""
        for reader in self.shards.values():
            reader.close()

    def __enter__(self) -> ModelReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_model(directory: Path, max_header: int = MAX_HEADER) -> ModelReader:
    """Open the model of a checkpoint directory, single-file or sharded (index checked), or
    the tensors of a LoRA adapter (``adapter_model.safetensors``); ``max_header``: the most
    bytes a safetensors header (or the shard index) may have, checked before reading it."""
    directory = Path(directory)

    def checked(path: Path) -> SafetensorsReader:
        return SafetensorsReader(path, max_header)

    single, index = directory / MODEL_FILE, directory / INDEX_FILE
    if single.is_file() and index.is_file():
        raise CheckpointError(f"{directory}: holds both {MODEL_FILE} and {INDEX_FILE}.")
    if (directory / ADAPTER_FILE).is_file():
        if single.is_file() or index.is_file():
            raise CheckpointError(f"{directory}: holds both an adapter ({ADAPTER_FILE}) and a "
                                  "model.")
        return ModelReader(directory, {ADAPTER_FILE: checked(directory / ADAPTER_FILE)}, None)
    if single.is_file():
        return ModelReader(directory, {MODEL_FILE: checked(single)}, None)
    if not index.is_file():
        raise CheckpointError(f"{directory}: neither {MODEL_FILE} nor {INDEX_FILE}.")
    weight_map = read_index(index, min(MAX_INDEX_BYTES, max_header))
    readers: dict[str, SafetensorsReader] = {}
    try:
        for file in sorted(set(weight_map.values())):
            if not (directory / file).is_file():
                raise CheckpointError(f"{INDEX_FILE}: lists {file}, which is missing.")
            readers[file] = checked(directory / file)
        seen: dict[str, str] = {}
        for file, reader in readers.items():
            for name in reader.entries:
                if name in seen:
                    raise CheckpointError(f"tensor {name!r} is in both {seen[name]} and {file}.")
                if name not in weight_map:
                    raise CheckpointError(f"{file}: tensor {name!r} is not in {INDEX_FILE}.")
                if weight_map[name] != file:
                    raise CheckpointError(
                        f"{INDEX_FILE}: tensor {name!r} is in {file}, the index says "
                        f"{weight_map[name]}."
                    )
                seen[name] = file
        for name, file in weight_map.items():
            if name not in seen:
                raise CheckpointError(f"{INDEX_FILE}: tensor {name!r} is not in {file}.")
    except BaseException:
        for reader in readers.values():
            reader.close()
        raise
    return ModelReader(directory, readers, INDEX_FILE)
