"""The most bytes and files one copy from a site may hold: from the run's round-0 global.

A compromised facility account can send back anything in place of an update; what it lists
is refused before a byte is written when it exceeds these caps
(:func:`xffl.workflows.extensions.copies.check_listing`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

MAX_COPY_BYTES = 4 << 40  # 4 TiB: far above a checkpoint, far below a full disk's worth
MAX_COPY_MEMBERS = 100_000  # files and folders of one copy; a checkpoint has a few hundred
# beyond copyFactor x the reference: an update's JSON files (manifest, config, index,
# slurm_job.json, ...; the coordinator reads each only below 16 MiB) and their folders
COPY_SLACK_BYTES = 64 << 20
COPY_SLACK_MEMBERS = 64
DEFAULT_COPY_FACTOR = 4.0  # an update in fp32 of a 16-bit global is 2x; twice that again


@dataclass(frozen=True)
class CopyCaps:
    """The most bytes and members (files and folders) one copy from a site may hold."""

    bytes: int = MAX_COPY_BYTES
    members: int = MAX_COPY_MEMBERS


def reference_caps(reference: str | None, factor: float, ceiling: CopyCaps) -> CopyCaps:
    """The caps of a copy that holds at most ``factor`` times the files under ``reference``.

    ``reference`` is the run's round-0 global: its kind (a whole model, a LoRA adapter) is
    what every update of the run has. Without one, or before it exists, ``ceiling``.
    """
    if reference is None or not os.path.isdir(reference):
        return ceiling
    size = count = 0
    for folder, dirs, files in os.walk(reference):
        count += len(dirs) + len(files)
        size += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return CopyCaps(bytes=min(ceiling.bytes, math.ceil(factor * size) + COPY_SLACK_BYTES),
                    members=min(ceiling.members,
                                math.ceil(factor * (count + 1)) + COPY_SLACK_MEMBERS))
