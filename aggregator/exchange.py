"""The checkpoint exchange format between sites and coordinator.

A checkpoint is a directory holding the model (``model.safetensors``, or Hugging Face shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; see
:mod:`xffl.aggregator.shards`), ``config.json`` for the model architecture and
``manifest.json``: format version and the xffl version that wrote it, run id, round, site,
sample and token counts, metrics, the sha256 of every file, the tensor index and the digest of the
parent global checkpoint. Directories are written under a temporary name, fsynced and then
renamed, so a reader sees a whole checkpoint or none. Nothing here unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xffl.aggregator.names import MANIFEST_FILE as MANIFEST_FILE  # the checkpoint's manifest
from xffl.aggregator.safetensors_io import MAX_HEADER, SafetensorsReader
from xffl.aggregator.shards import (
    ADAPTER_FILE,
    INDEX_FILE,
    MODEL_FILE,
    TensorReader,
    open_model,
)
from xffl.aggregator.shards import CONFIG_FILE as CONFIG_FILE  # the model's config.json
from xffl.core.errors import CheckpointError
from xffl.core.versions import FORMAT_VERSION as FORMAT_VERSION  # the exchange format's
from xffl.core.versions import VERSION_PATTERN, format_mismatch, same_format, xffl_version
from xffl.core.words import WORD_CHARS, capped

MAX_JSON_BYTES = 16 << 20  # manifest.json, config.json, an index json: read only below this
_CHUNK = 8 << 20


class TensorInfo(BaseModel):
    """One entry of the tensor index: name, safetensors dtype string, shape."""

    model_config = ConfigDict(extra="forbid")
    name: str
    dtype: str
    shape: list[int]


class Manifest(BaseModel):
    """The manifest.json of a checkpoint directory."""

    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    #: the xffl that wrote the checkpoint (:func:`finalize_manifest` sets it; a site's word)
    xffl_version: str | None = Field(default=None, pattern=VERSION_PATTERN)
    kind: Literal["update", "global"]
    run_id: str
    round: int = Field(ge=0)
    site: str | None = None
    num_samples: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)
    metrics: dict[str, float] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict)
    tensors: list[TensorInfo] = Field(default_factory=list)
    parent: str | None = None
    created: float = Field(default_factory=time.time)
    extra: dict[str, Any] = Field(default_factory=dict)

    def digest(self) -> str:
        """The checkpoint's identity: sha256 over its sorted file checksums."""
        return digest_of_files(self.files)


def digest_of_files(files: dict[str, str]) -> str:
    """Combine per-file sha256 values into one digest (order independent)."""
    joined = "\n".join(f"{name}:{files[name]}" for name in sorted(files))
    return hashlib.sha256(joined.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short).")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER:
                raise CheckpointError(f"{path}: safetensors header too large ({size} bytes).")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc}).") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object.")
    header.pop("__metadata__", None)
    return header


def index_of(reader: TensorReader | SafetensorsReader) -> list[TensorInfo]:
    """The tensor index (sorted by name) of an open model or safetensors file."""
    return [
        TensorInfo(name=e.name, dtype=e.dtype, shape=list(e.shape))
        for e in sorted(reader.entries.values(), key=lambda e: e.name)
    ]


def tensor_index(path: Path) -> list[TensorInfo]:
    """The tensor index, sorted by name, of a safetensors file or a checkpoint's model."""
    if Path(path).is_dir():
        with open_model(path) as reader:
            return index_of(reader)
    header = read_safetensors_header(path)
    return [
        TensorInfo(name=name, dtype=str(meta["dtype"]), shape=[int(d) for d in meta["shape"]])
        for name, meta in sorted(header.items())
    ]


def fsync_path(path: Path) -> None:
    """fsync a file or folder by its path (a folder: the names in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success fsync it and rename it into place.

    If ``final`` already exists it is replaced only after the new content is complete.
    On an exception the temporary directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        yield tmp
        for child in tmp.iterdir():
            fsync_path(child)
        fsync_path(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finalize_manifest(
    directory: Path, manifest: Manifest, *, checksums: Mapping[str, str] | None = None
) -> Manifest:
    """Fill in file checksums, the tensor index and this xffl's version, then write
    manifest.json into ``directory``.

    ``checksums`` may carry sha256 values the caller computed while writing a file (the
    streaming aggregator hashes its output as it goes), so that file is not read again.
    """
    known = dict(checksums or {})
    files = {
        p.name: known[p.name] if p.name in known else sha256_file(p)
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }
    full = manifest.model_copy(update={"files": files, "tensors": tensor_index(directory),
                                       "xffl_version": xffl_version()})
    (directory / MANIFEST_FILE).write_text(full.model_dump_json(indent=2) + "\n")
    return full


def read_small_file(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (links and bigger files refused).

    The size is checked before anything is read, so a site cannot make the coordinator load
    a file of any size it likes; the file is opened without following a link.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file.")
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than the {limit} allowed.")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit + 1)
    finally:
        os.close(fd)


def _other_format(raw: bytes) -> str | None:
    """Why a manifest that is not this format's is refused (both versions), or None: read
    before its fields are, since another format's fields are not this one's."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or "format_version" not in data or \
            same_format(data["format_version"]):
        return None
    return format_mismatch(data["format_version"], data.get("xffl_version"))


def read_manifest(directory: Path) -> Manifest:
    """Parse a checkpoint's manifest.json (no checksum verification); one of another
    exchange format is refused naming both formats and both xffl versions."""
    path = Path(directory) / MANIFEST_FILE
    raw = b""
    try:
        raw = read_small_file(path)
        return Manifest.model_validate_json(raw)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory}: no {MANIFEST_FILE}.") from exc
    except OSError as exc:  # a link (ELOOP with O_NOFOLLOW), a folder, unreadable
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc}).") from exc
    except ValidationError as exc:
        other = _other_format(raw)
        if other is not None:
            raise CheckpointError(f"{path}: {other}.") from exc
        first = exc.errors()[0]
        loc = capped(".".join(str(p) for p in first["loc"]), WORD_CHARS)  # keys are the site's
        raise CheckpointError(f"{path}: invalid manifest ({loc}: {first['msg']}).") from exc


def verify_checkpoint(directory: Path) -> Manifest:
    """Check every file's sha256 and the tensor index against the manifest; return it.

    The model is ``model.safetensors`` or an index json whose shards must all be listed.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if not same_format(manifest.format_version):
        raise CheckpointError(
            f"{directory}: {format_mismatch(manifest.format_version, manifest.xffl_version)}.")
    if not {MODEL_FILE, INDEX_FILE, ADAPTER_FILE} & set(manifest.files):
        raise CheckpointError(
            f"{directory}: the manifest lists neither {MODEL_FILE} nor {INDEX_FILE} (nor an "
            f"adapter's {ADAPTER_FILE})."
        )
    for name, expected in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: {name} is missing.")
        actual = sha256_file(path)
        if actual != expected:
            raise CheckpointError(
                f"{directory}: checksum mismatch for {name} (file corrupted or truncated)."
            )
    try:
        reader = open_model(directory)
    except CheckpointError as exc:
        where = "" if exc.message.startswith(str(directory)) else f"{directory}: "
        raise CheckpointError(f"{where}{exc.message}") from exc
    with reader:
        unlisted = [f for f in reader.files if f not in manifest.files]
        if unlisted:
            raise CheckpointError(f"{directory}: the manifest does not list {unlisted[0]}.")
        if index_of(reader) != manifest.tensors:
            raise CheckpointError(f"{directory}: the tensor index differs from the manifest.")
    return manifest
