"""Pytest fixtures for the two-facility SLURM + SSH stack (see tests/stack/stack.py).

Register them from ``tests/conftest.py`` (see ``tests/stack/conftest_snippet.txt``).
Environment knobs:

* ``XFFL_STACK_DIR``: state directory (default ``<tempdir>/xffl-stack``).
* ``XFFL_STACK_PORTS``: ``alpha=CTLD:SLURMD:SSH,beta=...`` or ``auto`` (free ports).
* ``XFFL_STACK_KEEP=1``: leave a stack this session started running at the end.
* ``XFFL_STACK_INSTALL=1`` (implied by ``CI=true``): run scripts/install-system-deps.sh when
  the SLURM/munge/sshd binaries are missing.
A stack that cannot start FAILS the tests that need it. Every such test carries the
``stack`` marker (added at collection), so ``-m "not stack"`` leaves them out explicitly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import stack
from tests.stack.stack import ClusterInfo, StackError, StackInfo

__all__ = ["ClusterInfo", "StackError", "StackInfo", "slurm_stack", "stack"]

INSTALL_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-system-deps.sh"


class _Session:
    """Process-wide state, so that the fixture brings the stack up at most once per process
    even when it is registered by more than one conftest."""

    info: StackInfo | None = None
    error: str | None = None
    started: bool = False
    users: int = 0


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def _unavailable(reason: str) -> None:
    pytest.fail(f"SLURM/SSH test stack unavailable: {reason} (`-m \"not stack\"` leaves "
                "out the tests that need it)", pytrace=False)


def _bring_up() -> tuple[StackInfo | None, str | None, bool]:
    """(info, error, started_by_us).

    Each pytest-xdist worker gets its own stack (instance N for worker gwN), so stack tests
    run in parallel without stopping each other's controllers.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        os.environ.setdefault("XFFL_STACK_INSTANCE", worker[2:])
    if sys.platform != "linux":
        return None, f"needs Linux, not {sys.platform}", False
    if os.geteuid() != 0:
        return None, "needs root (slurmd and sshd run as root)", False
    missing = stack.missing_binaries()
    if missing and (_in_ci() or os.environ.get("XFFL_STACK_INSTALL") == "1"):
        try:
            r = subprocess.run(
                ["bash", str(INSTALL_SCRIPT)],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{INSTALL_SCRIPT} failed: {exc}", False
        if r.returncode != 0:
            return None, f"{INSTALL_SCRIPT} failed:\n{r.stderr[-3000:]}", False
        missing = stack.missing_binaries()
    if missing:
        return (
            None,
            (
                f"missing {', '.join(missing)}; run {INSTALL_SCRIPT} as root "
                "(or set XFFL_STACK_INSTALL=1)"
            ),
            False,
        )
    state_dir = stack.default_dir()
    info, problems = stack.status(state_dir)
    if info is not None and not problems:
        return info, None, False
    try:
        info = stack.up(state_dir)
    except (StackError, OSError, subprocess.SubprocessError) as exc:
        # Do not leave half a stack running; the logs stay under the state directory.
        try:
            stack.down(state_dir)
        except Exception as down_exc:
            return None, f"{exc}\n(and stopping it again failed: {down_exc})", False
        return None, str(exc), False
    return info, None, True


@pytest.fixture(scope="session")
def slurm_stack() -> Iterator[StackInfo]:
    """Two SLURM clusters (alpha, beta) behind one sshd on 127.0.0.1, as a ``StackInfo``.

    Reuses a healthy stack; stops at session end only what this session started.
    """
    if _Session.info is None and _Session.error is None:
        _Session.info, _Session.error, _Session.started = _bring_up()
    if _Session.error is not None or _Session.info is None:
        _unavailable(_Session.error or "unknown error")
    assert _Session.info is not None
    _Session.users += 1
    try:
        yield _Session.info
    finally:
        _Session.users -= 1
        if _Session.users == 0 and _Session.started and os.environ.get("XFFL_STACK_KEEP") != "1":
            stack.down(_Session.info.dir)
            _Session.info, _Session.started = None, False
