"""A run's global model written out for other tools: the checkpoint's own files without xffl's
manifest and server state, or a LoRA adapter merged into its base (:mod:`xffl.aggregator.merge`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from xffl.aggregator.exchange import read_manifest, staged_dir
from xffl.aggregator.kinds import kind_of
from xffl.aggregator.merge import merge_adapter
from xffl.core.errors import InvalidInput
from xffl.core.layout import RunLayout


def export_global(layout: RunLayout, rnd: int, out: Path, *, merge: bool = False,
                  max_shard_bytes: int | None = None) -> list[str]:
    """Write the global model after round ``rnd`` into ``out``; return the files written.

    ``merge``: a LoRA run's adapter folded into its base (``rounds/0/base``).
    """
    source = layout.global_dir(rnd)
    if merge and not kind_of(source).adapter:
        raise InvalidInput("--merge folds a LoRA adapter into its base, but this run trains "
                           "the whole model; leave --merge out.")
    if merge:
        merge_adapter(layout.base_model, source, out, max_shard_bytes)
        return sorted(p.name for p in out.iterdir())
    # the model's files (tensors, index, config), not the server state beside them
    names = sorted(n for n in read_manifest(source).files if not n.startswith("server_"))
    with staged_dir(Path(out)) as tmp:
        for name in names:
            shutil.copyfile(source / name, tmp / name)
    return names
