"""A cache of seeded initial models, so that a run does not build the same round-0 model again.

The seeded round-0 global is a pure function of the model spec, the seed, the shard size and
the code that initialises it (``INIT_VERSION``, the numpy, torch and transformers versions).
Writing it imports torch (2 CPU-seconds in every run's supervisor) and, for a 7B preset,
streams 27 GB through numpy's generator for a minute or more (:mod:`xffl.training.seeded`).
The first run writes its initial model into the cache; a later run with the same key
verifies the entry (every checksum) and takes its files (hard links, else copies) under a
manifest of its own. Entries live in ``$XDG_CACHE_HOME/xffl/init/<key>`` (else
``~/.cache/xffl``), owner-only, written atomically. A model from ``model.init`` or
``model.entry_point`` is never cached: its weights come from files or code xffl does not
version.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from xffl.aggregator.exchange import (
    MANIFEST_FILE,
    finalize_manifest,
    read_manifest,
    staged_dir,
    verify_checkpoint,
)
from xffl.core.errors import CheckpointError
from xffl.core.files import link_files
from xffl.core.paths import private_dir
from xffl.training.arch import INIT_VERSION
from xffl.training.config import ModelSpec


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/xffl``, else ``~/.cache/xffl``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "xffl"


def init_key(model: ModelSpec, seed: int, max_shard_bytes: int | None) -> str | None:
    """The cache key of a seeded initial model, or None when it is not cacheable."""
    if model.init is not None or model.entry_point is not None:
        return None
    try:  # numpy draws the values (xffl.training.seeded), transformers lays out the tensors
        versions = {lib: metadata.version(lib) for lib in ("numpy", "torch", "transformers")}
    except metadata.PackageNotFoundError:
        return None
    data = {"init": INIT_VERSION, **versions, "seed": seed,
            "shard": max_shard_bytes,
            "model": model.model_dump(mode="json", exclude={"tokenizer"})}  # no part of the weights
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:40]


def reuse(key: str, out_dir: Path, run_id: str) -> bool:
    """Put the cached model ``key`` into ``out_dir`` as ``run_id``'s round 0; False if none.

    An entry that does not verify is not used (and is replaced when the run stores its own).
    """
    entry = cache_root() / "init" / key
    if not (entry / MANIFEST_FILE).is_file():
        return False
    try:
        cached = verify_checkpoint(entry)
    except (CheckpointError, OSError):
        return False
    try:
        with staged_dir(Path(out_dir)) as tmp:
            link_files(entry, tmp, sorted(cached.files))
            finalize_manifest(tmp, cached.model_copy(update={"run_id": run_id}),
                              checksums=cached.files)
    except OSError:  # the entry was replaced meanwhile (another run stored the same key)
        return False
    return True


def store(key: str, model_dir: Path) -> bool:
    """Keep the initial model in ``model_dir`` as the cache entry ``key``; False if it could
    not be written (a cache is an optimisation: the run goes on without it)."""
    try:
        manifest = read_manifest(Path(model_dir))  # just written, with its checksums
        private_dir(cache_root() / "init")
        with staged_dir(cache_root() / "init" / key) as tmp:
            link_files(Path(model_dir), tmp, [*sorted(manifest.files), MANIFEST_FILE])
    except (CheckpointError, OSError):
        return False
    return True
