"""Fold a LoRA adapter into its base model, tensor by tensor: a plain Hugging Face checkpoint.

For every adapted linear ``M`` the merged weight is ``W + (alpha / r) B A`` (peft's
``merge_and_unload``), computed in float64 from the stored values and rounded once to the
base's dtype; every other tensor is copied. One base tensor (and its merged copy) is in
memory at a time, as in the aggregator, so a 7B base merges in about one layer's RAM.

An adapted ``lm_head`` of a base that ties it to the input embedding (``tie_word_embeddings``:
its checkpoint holds ``model.embed_tokens.weight`` only) gets a weight of its own, the
embedding plus the adapter's product, and the merged config.json unties them: the adapted
model changes the head's output, never the embedding's (merging into the shared tensor would
change both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.adapter import adapted_modules, factor_names
from xffl.aggregator.dtypes import STORAGE_DTYPES, decode, encode
from xffl.aggregator.exchange import read_small_file, staged_dir
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, CONFIG_FILE, open_model
from xffl.core.errors import CheckpointError

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"  # the tied pair's names


def adapter_scaling(adapter_dir: Path) -> float:
    """``lora_alpha / r`` of an adapter checkpoint's adapter_config.json."""
    path = Path(adapter_dir) / ADAPTER_CONFIG_FILE
    try:
        config: Any = json.loads(read_small_file(path))
        r, alpha = config["r"], config["lora_alpha"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable adapter config ({exc}).") from exc
    ok = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (r, alpha))
    if not ok or r <= 0 or not alpha > 0 or not math.isfinite(alpha):
        raise CheckpointError(f"{path}: r and lora_alpha must be positive numbers.")
    return float(alpha) / float(r)


def merge_adapter(base_dir: Path, adapter_dir: Path, out_dir: Path,
                  max_shard_bytes: int | None = None) -> dict[str, str]:
    """Write ``base_dir`` with ``adapter_dir`` merged into ``out_dir`` (config.json copied
    from the base); return {file: sha256} of the tensor files."""
    scaling = adapter_scaling(adapter_dir)
    config_bytes = (Path(base_dir) / CONFIG_FILE).read_bytes()
    with open_model(Path(base_dir)) as base, open_model(Path(adapter_dir)) as adapter:
        try:
            modules = adapted_modules(adapter.entries)
        except ValueError as exc:
            raise CheckpointError(f"{adapter_dir}: {exc}.") from exc
        targets = {f"{m}.weight": m for m in modules}
        source = {n: n for n in base.entries}  # each written tensor: the base tensor it starts as
        if HEAD in targets and HEAD not in base.entries and EMBEDDING in base.entries:
            config_bytes = _untied(base_dir, config_bytes)
            source[HEAD] = EMBEDDING
        missing = sorted(set(targets) - set(source))
        if missing:
            raise CheckpointError(f"{base_dir}: has no tensor {missing[0]!r}, which the adapter "
                                  "adapts.")
        names = sorted(source)
        entries = [(n, base.entries[source[n]].dtype, base.entries[source[n]].shape)
                   for n in names]
        with staged_dir(Path(out_dir)) as tmp:
            with ShardedWriter(tmp, entries, {"format": "pt"},
                               max_shard_bytes=max_shard_bytes) as writer:
                for name in names:
                    entry = base.entries[source[name]]
                    raw = base.raw(source[name])
                    if name in targets:
                        a_name, b_name = factor_names(targets[name])
                        a = decode(adapter.raw(a_name), adapter.entries[a_name].dtype)
                        b = decode(adapter.raw(b_name), adapter.entries[b_name].dtype)
                        a = a.reshape(adapter.entries[a_name].shape)
                        b = b.reshape(adapter.entries[b_name].shape)
                        w = decode(raw, entry.dtype).reshape(entry.shape)
                        if (b.shape[0], a.shape[1]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
                            raise CheckpointError(
                                f"{adapter_dir}: the factors of {targets[name]} do not fit "
                                f"its weight of shape {tuple(w.shape)}.")
                        merged = (w + scaling * (b @ a)).reshape(-1)
                        out = np.empty(merged.size, dtype=STORAGE_DTYPES[entry.dtype])
                        encode(merged, entry.dtype, out, np.empty(merged.size, np.float32))
                        writer.write_chunk(name, out)
                    else:
                        writer.write_chunk(name, np.ascontiguousarray(raw))
            (tmp / CONFIG_FILE).write_bytes(config_bytes)
            return writer.checksums


def _untied(base_dir: Path, config_bytes: bytes) -> bytes:
    """The base's config.json with ``tie_word_embeddings`` false; a base whose config does
    not tie them has no lm_head to adapt."""
    try:
        config: Any = json.loads(config_bytes)
    except ValueError as exc:
        raise CheckpointError(f"{base_dir / CONFIG_FILE}: not JSON ({exc}).") from exc
    if not isinstance(config, dict) or config.get("tie_word_embeddings") is not True:
        raise CheckpointError(f"{base_dir}: has no tensor {HEAD!r}, which the adapter adapts, "
                              "and its config.json does not tie it to the embedding.")
    return (json.dumps({**config, "tie_word_embeddings": False}, indent=2, sort_keys=True)
            + "\n").encode()
