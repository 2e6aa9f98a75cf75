"""Failpoints: named places where a test can make this process die, to prove recovery.

``XFFL_FAILPOINT=NAME`` makes :func:`failpoint` ``NAME`` SIGKILL the calling process, the way
an OOM killer would; ``XFFL_FAILPOINT=NAME@group`` SIGKILLs its whole process group, the way
a crash of the coordinator would take the supervisor and every step it runs (the supervisor
leads its own session). No cleanup, no exception handler runs. Used by the tests of ``xffl
resume``; unset, a failpoint costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "XFFL_FAILPOINT"
GROUP = "@group"


def failpoint(name: str) -> None:
    """Die here (SIGKILL) if $XFFL_FAILPOINT names this point."""
    wanted = os.environ.get(ENV)
    if wanted == name:
        os.kill(os.getpid(), signal.SIGKILL)
    elif wanted == name + GROUP:
        os.killpg(os.getpgrp(), signal.SIGKILL)
