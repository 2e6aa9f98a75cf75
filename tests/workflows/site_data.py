"""Token-shard folders as `xffl data prepare` writes them (train.bin + meta.json), for the
checks `xffl submit` makes of each site's data before anything is queued, and their cases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_shards(folder: Path, num_tokens: int, vocab_size: int = 256) -> Path:
    """``num_tokens`` uint16 tokens below ``vocab_size`` and their meta.json in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.arange(num_tokens, dtype=np.uint16) % min(vocab_size, 256)
    (folder / "train.bin").write_bytes(tokens.tobytes())
    (folder / "meta.json").write_text(json.dumps(
        {"dtype": "uint16", "num_tokens": num_tokens, "vocab_size": vocab_size,
         "tokenizer": "bytes"}))
    return folder


def bad_data(case: str, tmp_path: Path, marker: Path) -> tuple[str, str]:
    """(data.path for the job spec, the folder the refusal names) of one bad case: the
    folder ``missing`` (its path also tries to run ``touch MARKER`` in the site's shell),
    ``relative`` (prepared beside the job file, but a relative path is read under the site's
    workdir), ``empty`` (no tokens), ``vocab`` (tokenized for 50,000 tokens; tiny has 256)."""
    if case == "missing":
        path = f"{tmp_path}/nodata; touch {marker}"
        return path, path
    if case == "relative":
        write_shards(tmp_path / "prepared", 4096)  # beside the job file, not in the workdir
        return "prepared", "/prepared"
    if case == "empty":
        return str(write_shards(tmp_path / "empty", 0)), str(tmp_path / "empty")
    assert case == "vocab"
    return str(write_shards(tmp_path / "big", 4096, 50_000)), str(tmp_path / "big")
