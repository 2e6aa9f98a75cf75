"""Process start-up: fewer garbage collections while a process imports torch and transformers.

CPython 3.11 collects its youngest generation every 700 net allocations and, every tenth of
those, the next, up to the whole heap. Importing torch and transformers creates hundreds of
thousands of objects that live as long as the process, and the collector walks them again and
again: of the 3.4 CPU-seconds the imports of a training process took here, 0.8 were
collections (2.6 s with the collector off, 2.9 s with a first generation of 50,000). Every
process xffl starts calls :func:`collect_less` first; cycles are still collected, later.
"""

from __future__ import annotations

import gc

YOUNG = 50_000  # net allocations between collections of the youngest generation


def collect_less() -> None:
    """Collect the youngest generation every YOUNG allocations (never more often than now)."""
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG:
        gc.set_threshold(YOUNG, middle, old)
