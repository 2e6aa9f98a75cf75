"""What an update's folder may hold: decided by the kind of the global, never by its manifest.

A whole-model global's updates hold ``model.safetensors`` (or Hugging Face shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``) and
``config.json``; a LoRA global's hold ``adapter_model.safetensors`` and
``adapter_config.json``. A manifest that lists any other name (a ``.pth`` with a correct
checksum, ``slurm_job.json``, ...) is a rejection of the update: nothing else is kept or sent
on. Beside the listed files the folder may hold only the coordinator's known side files
(``slurm_job.json``), each under its cap. The config must equal the global's as a JSON
value; its bytes are never used (the global's config is the coordinator's).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from xffl.aggregator.exchange import MANIFEST_FILE, MAX_JSON_BYTES, Manifest, read_small_file
from xffl.aggregator.kinds import ModelKind
from xffl.core.errors import CheckpointError
from xffl.core.words import quoted


def check_listed(files: Iterable[str], kind: ModelKind) -> None:
    """The manifest lists only plain file names, those an update of the global's ``kind``
    holds (its tensors, its config). Raises CheckpointError naming the first file an update
    of that kind never holds, or the tensor file it lacks."""
    names = set(files)
    for name in sorted(names):
        if name in ("", ".", "..", MANIFEST_FILE) or Path(name).name != name:
            raise CheckpointError(f"the manifest lists {quoted(name)}, which is not a plain file "
                                  "name")
    kind.check_listed(names)


def check_contents(directory: Path, manifest: Manifest, side_files: Mapping[str, int]) -> None:
    """The folder holds only regular files the manifest lists (or side files), under caps.

    Raises CheckpointError naming the first file that is a link, a folder or another kind of
    entry, that no one listed, or that is bigger than its cap (json files and side files).
    """
    allowed = {MANIFEST_FILE, *manifest.files, *side_files}
    with os.scandir(directory) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointError(f"{quoted(entry.name)} is a symbolic link")
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{quoted(entry.name)} is not a regular file")
            if entry.name not in allowed:
                raise CheckpointError(f"{quoted(entry.name)} is not listed in the manifest")
            cap = side_files.get(entry.name, MAX_JSON_BYTES if entry.name.endswith(".json")
                                 else None)
            if cap is not None and st.st_size > cap:
                raise CheckpointError(f"{entry.name} is {st.st_size} bytes, more than the "
                                      f"{cap} allowed")


def check_config(directory: Path, expected: Mapping[str, Any], kind: ModelKind) -> None:
    """The update's config file of its ``kind`` is the global model's (config.json: the
    architecture did not change; adapter_config.json: rank, scaling and targets did not)."""
    name = kind.config_file
    try:
        got = json.loads(read_small_file(directory / name))
    except FileNotFoundError as exc:
        raise CheckpointError(f"no {name}") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable {name} ({exc})") from exc
    if got != expected:
        raise CheckpointError(f"{name} differs from the global model's")
