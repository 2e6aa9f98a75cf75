"""Rejected updates on the coordinator: kept a while for a look, within a count and a size.

An update that an SSH site sends back is copied into the run's StreamFlow work folders
(``streamflow/work``) before admission judges it; one rejected stayed there for ever, up to
``copyFactor`` times the model per round per hostile site. What ``xffl status`` shows of a
rejection is its reason, in the round's verdict and the registry, never the update's files.
So a rejected copy is moved to ``rounds/<r>/rejected/<site>`` and the run keeps only the
``KEEP_COUNT`` newest of them that fit, in all, in ``KEEP_GLOBALS`` times the bytes of the
round's global; the rest are removed. An update that is not such a copy (a
``local`` site's own folder on this machine) is left where it is.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from xffl.core.layout import RunLayout

KEEP_COUNT = 4  # the rejected updates of the last round or two of a few sites
KEEP_GLOBALS = 2.0  # ... in all at most the bytes of two globals


def tree_bytes(path: Path) -> int:
    """The bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def _copied_here(layout: RunLayout, update: Path) -> bool:
    """Whether ``update`` is a folder StreamFlow copied into the run's work folders."""
    work = os.path.realpath(layout.coordinator_workdir)
    return (update.is_dir() and not update.is_symlink()
            and os.path.commonpath([os.path.realpath(update), work]) == work)


def kept_rejected(layout: RunLayout) -> list[Path]:
    """The rejected updates the run keeps, newest round first."""
    out = []
    for folder in layout.root.glob("rounds/*/rejected/*"):
        if folder.parent.parent.name.isdigit() and folder.is_dir() \
                and not folder.is_symlink():
            out.append(folder)
    return sorted(out, key=lambda p: (-int(p.parent.parent.name), p.name))


def keep_rejected(layout: RunLayout, rnd: int, site: str, update: Path,
                  global_dir: Path) -> Path | None:
    """Move ``site``'s rejected copy ``update`` of round ``rnd`` out of the work folders and
    prune the kept ones (see the module doc); where it is kept, or None once removed."""
    if not _copied_here(layout, update):
        return None
    target = layout.rejected_update(rnd, site)
    if target.exists():  # an earlier attempt of the same round's step
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.replace(update, target)
    budget, kept = KEEP_GLOBALS * tree_bytes(global_dir), 0
    for folder in kept_rejected(layout):  # the newest that fit, at most KEEP_COUNT
        size = tree_bytes(folder)
        if kept < KEEP_COUNT and size <= budget:
            kept, budget = kept + 1, budget - size
        else:
            shutil.rmtree(folder, ignore_errors=True)
    return target if target.exists() else None
