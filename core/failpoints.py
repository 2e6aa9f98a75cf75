"""Failpoints: named places where a test can make this process die, to prove recovery.

``XFFL_FAILPOINT=NAME`` makes :func:`failpoint` ``NAME`` SIGKILL the calling process, the
way an OOM killer or a power cut would: no cleanup, no exception handler runs. Used by the
tests of ``xffl resume``; unset, a failpoint costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "XFFL_FAILPOINT"


def failpoint(name: str) -> None:
    """Die here (SIGKILL) if $XFFL_FAILPOINT names this point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
