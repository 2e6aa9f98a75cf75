"""Imported first by a process xffl starts without a ``main`` of its own: ``collect_less()``.

multiprocessing's fork server (``xffl simulate``'s workers are forked from one) runs
multiprocessing's own entry point, which imports the modules it is told to preload, in
order. Named first among them, this module gives that process what every other process xffl
starts does first (:mod:`xffl.core.startup`): fewer collections while it imports torch and
the trainer, and no full collections over that heap at its exit.
"""

from __future__ import annotations

from xffl.core.startup import collect_less

collect_less()
