"""Process start-up: fewer garbage collections while a process imports torch and transformers.

CPython 3.11 collects its youngest generation every 700 net allocations and, every tenth of
those, the next, up to the whole heap. Importing torch and transformers creates hundreds of
thousands of objects that live as long as the process, and the collector walks them again and
again: of the 3.4 CPU-seconds the imports of a training process took here, 0.8 were
collections (2.6 s with the collector off, 2.9 s with a first generation of 50,000). Every
process xffl starts calls :func:`collect_less` first; cycles are still collected, later.

The same heap costs again at the end: after the ``atexit`` handlers, the interpreter's
finalisation runs full collections over every object the process still holds, whether or not
the collector is enabled. That was 0.75 of the 3.15 CPU-seconds a tiny training round took
here (a process doing nothing else than importing transformers' Llama: 3.3 -> 2.6). So
:func:`collect_less` also registers :func:`gc.freeze` to run after every other exit handler:
the objects alive at that point move to the permanent generation, which those collections
skip. What the process wrote is closed by then (checkpoints are written, flushed and renamed
before a process returns; the standard streams and logging are flushed by their own handlers
or by the interpreter, not by the collector); only garbage cycles still alive at exit are not
torn down, which the operating system reclaims with the process.
"""

from __future__ import annotations

import atexit
import functools
import gc

YOUNG = 50_000  # net allocations between collections of the youngest generation


def collect_less() -> None:
    """Collect the youngest generation every YOUNG allocations (never more often than now),
    and skip the collector's passes over the whole heap at the interpreter's exit."""
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG:
        gc.set_threshold(YOUNG, middle, old)
    _freeze_at_exit()


@functools.cache  # once per process: the CLI calls collect_less() per command
def _freeze_at_exit() -> None:
    """Register gc.freeze with atexit. atexit runs its handlers last registered first:
    registered first in a process, this one runs after every handler the imports and the
    program register."""
    atexit.register(gc.freeze)
