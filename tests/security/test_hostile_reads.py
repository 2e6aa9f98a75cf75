"""xffl-ssh against a facility whose answers never end: bounded reads, a deadline on a copy.

A hostile sshd (tests/security/hostile_sshd.py, a real SSH server on 127.0.0.1 in a process
of its own) answers xffl-ssh's real connector: a 256 MiB listing, a hardware probe that
prints for ever, a 1 GB ``sha256sum`` answer, a folder test that never ends, and a copy that
trickles a byte inside each stall window. Each ends as a failure of that copy or probe (what
the site failure manager records as the site's) before the bound the test states, and the
peak RSS of this process, which runs the copies as the coordinator's StreamFlow process does,
stays within ``RSS_BOUND`` of what it was before.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from streamflow.core.deployment import ExecutionLocation
from streamflow.core.exception import WorkflowExecutionException

from xffl.workflows.extensions import login
from xffl.workflows.extensions.copies import (
    SHA256_ANSWER_BYTES,
    CopyDeadline,
    CopyRefused,
    remote_sha256,
)
from xffl.workflows.extensions.copy_paths import FOLDER_ANSWER_BYTES
from xffl.workflows.extensions.site_listing import ENTRY_BYTES
from xffl.workflows.extensions.ssh import XfflSshConnector

T = TypeVar("T")
RSS_BOUND = 200 << 20  # the bound on what one site may cost the coordinator
# no attack here may hold the test longer than this: each is refused or cut off after at
# most a few seconds of reading (the probe's timeout is set to 3 s here)
ENDED_WITHIN_S = 60.0
# the channel's window (xffl-ssh's COPY_WINDOW, 16 MiB) and the socket buffers on the way
# (a few MiB on loopback) are what a site can have sent beyond what xffl-ssh read
IN_FLIGHT = 24 << 20


@pytest.fixture(scope="module")
def hostile_sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(port, the file where the server notes what each answer sent)."""
    where = tmp_path_factory.mktemp("hostile-sshd")
    port_file, sent = where / "port", where / "sent"
    proc = subprocess.Popen([sys.executable, "-m", "tests.security.hostile_sshd",
                             str(port_file), str(sent)], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no hostile sshd"
            time.sleep(0.05)
        yield int(port_file.read_text()), sent
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _rss_peak() -> int:
    """This process's peak RSS in bytes (VmHWM)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) << 10  # type: ignore[union-attr]


def _rss_now() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10  # type: ignore[union-attr]


def _attack(aw: Awaitable[T]) -> tuple[BaseException | T, float, int]:
    """(what ``aw`` raised or gave, seconds it took, the peak RSS it added to this process)."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    start_rss, started = _rss_now(), time.monotonic()

    async def bounded() -> T:
        return await asyncio.wait_for(aw, ENDED_WITHIN_S)

    try:
        got: BaseException | T = asyncio.run(bounded())
    except Exception as exc:
        got = exc
    return got, time.monotonic() - started, _rss_peak() - start_rss


def _connector(port: int, user: str, tmp_path: Path, **config: Any) -> XfflSshConnector:
    config = {"connectTimeout": 5, **config}
    return XfflSshConnector(deployment_name="hostile", config_dir=str(tmp_path),
                            nodes=[f"127.0.0.1:{port}"], username=user, checkHostKey=False,
                            retries=1, retryDelay=0, copyStreamsFromRtt=False,
                            copyRetries=0, **config)


def _reference(tmp_path: Path) -> str:
    """A round-0 global of two files: copies back are capped by it (copyFactor 4)."""
    glob = tmp_path / "global"
    glob.mkdir()
    (glob / "model.safetensors").write_bytes(b"w" * 1000)
    (glob / "manifest.json").write_text("{}")
    return str(glob)


async def _copy_back(conn: XfflSshConnector, port: int, src: str, dst: Path) -> None:
    try:
        await conn.copy_remote_to_local(
            src, str(dst), ExecutionLocation(name=f"127.0.0.1:{port}", deployment="hostile"))
    finally:
        await conn.undeploy(False)


def _sent(sent: Path, word: str) -> int:
    """The bytes the server's last ``word`` answer got into the channel (waits for it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [line.split() for line in sent.read_text().splitlines()] \
            if sent.exists() else []
        got = [int(n) for w, n in lines if w == word]
        if got:
            return got[-1]
        time.sleep(0.05)
    raise AssertionError(f"the hostile sshd noted no {word} answer")


def test_a_256_mib_listing_is_refused_at_its_cap(hostile_sshd: tuple[int, Path],
                                                 tmp_path: Path) -> None:
    port, sent = hostile_sshd
    conn = _connector(port, "listing", tmp_path, copyReference=_reference(tmp_path))
    caps = conn.copy_caps()
    got, seconds, rss = _attack(_copy_back(conn, port, "/site/job/update", tmp_path / "back"))
    assert isinstance(got, CopyRefused), got
    assert f"more than {caps.members} files and folders" in str(got)
    assert seconds < ENDED_WITHIN_S and rss < RSS_BOUND, (seconds, rss >> 20)
    # xffl-ssh read no further than the listing's cap: the site got no more than that and
    # what was in flight into the channel (HEAD read all 256 MiB, and held ~12x that)
    assert _sent(sent, "find") < caps.members * ENTRY_BYTES + IN_FLIGHT
    assert not (tmp_path / "back").exists()


def test_an_honest_probe_is_read(hostile_sshd: tuple[int, Path], tmp_path: Path) -> None:
    port, _ = hostile_sshd
    conn = _connector(port, "honest", tmp_path)

    async def probe() -> Any:
        try:
            return await conn.get_available_locations()
        finally:
            await conn.undeploy(False)

    hardware = asyncio.run(probe())[f"127.0.0.1:{port}"].hardware
    assert (hardware.cores, hardware.memory) == (4.0, 1000.0)
    assert hardware.storage["/"].size == 2.0  # KiB / 2**10


@pytest.mark.parametrize(("user", "why"), [
    ("probe", f"printed more than {login.PROBE_BYTES} bytes"),
    ("probe-slow", "did not end within 3 s"),
])
def test_a_probe_that_prints_for_ever_fails_the_probe(
        hostile_sshd: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        user: str, why: str) -> None:
    monkeypatch.setattr(login, "PROBE_TIMEOUT_S", 3)
    port, _ = hostile_sshd
    conn = _connector(port, user, tmp_path)

    async def probe() -> Any:
        try:
            return await conn.get_available_locations()
        finally:
            await conn.undeploy(False)

    got, seconds, rss = _attack(probe())
    assert isinstance(got, WorkflowExecutionException), got
    assert "Impossible to retrieve available hardware" in str(got) and why in str(got)
    assert seconds < ENDED_WITHIN_S and rss < RSS_BOUND, (seconds, rss >> 20)


def test_a_shell_that_prints_for_ever_is_held_to_its_tail(
        hostile_sshd: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A login whose every command prints for ever: the persistent shell's start fails at
    its time limit, and the command run without it (upstream's way on) ends at its own;
    each holds only the tail of what came (upstream kept all of it)."""
    monkeypatch.setattr(login, "SHELL_START_TIMEOUT_S", 3)
    port, _ = hostile_sshd
    conn = _connector(port, "shell", tmp_path)

    async def echo() -> Any:
        try:
            return await conn.run(ExecutionLocation(name=f"127.0.0.1:{port}",
                                                    deployment="hostile"),
                                  ["echo", "hello"], capture_output=True, timeout=5)
        finally:
            await conn.undeploy(False)

    got, seconds, rss = _attack(echo())
    assert isinstance(got, (WorkflowExecutionException, TimeoutError)), got
    assert seconds < ENDED_WITHIN_S and rss < RSS_BOUND, (seconds, rss >> 20)


@pytest.mark.parametrize(("user", "word", "cap"), [
    ("sha", "sha256sum", SHA256_ANSWER_BYTES), ("folder", "folder", FOLDER_ANSWER_BYTES)])
def test_a_short_answer_that_never_ends_is_refused(hostile_sshd: tuple[int, Path],
                                                   tmp_path: Path, user: str, word: str,
                                                   cap: int) -> None:
    """The SHA-256 of a resumed piece's prefix; the folder test before a copy out."""
    port, sent = hostile_sshd
    conn = _connector(port, user, tmp_path)
    location = ExecutionLocation(name=f"127.0.0.1:{port}", deployment="hostile")

    async def ask() -> Any:
        try:
            if user == "sha":
                return await remote_sha256(conn._copier(location), "/site/update/x", 0, 10)
            await conn.copy_local_to_remote(_reference(tmp_path), "/site/job", [location])
        finally:
            await conn.undeploy(False)

    got, seconds, rss = _attack(ask())
    assert isinstance(got, WorkflowExecutionException), got
    assert f"more than {cap} bytes" in str(got)
    assert seconds < ENDED_WITHIN_S and rss < RSS_BOUND, (seconds, rss >> 20)
    assert _sent(sent, word) < IN_FLIGHT


@pytest.mark.parametrize(("config", "why"), [
    # 1 attempt x 2 s stall, and its bytes at 1 MB/s: the listing's (~30) and the file's 1000
    ({}, r"after 2 s, its deadline \(\d+ bytes at 1 MB/s and 1 attempt\(s\) of 2 s\)"),
    # the round's time limit, when it is the shorter
    ({"copyTimeout": 1.5, "copyMinRate": 1.0}, r"after 2 s, its deadline \(the round's time"),
])
def test_a_trickling_copy_fails_at_its_deadline(hostile_sshd: tuple[int, Path],
                                                tmp_path: Path, config: dict[str, Any],
                                                why: str) -> None:
    """One byte every 0.5 s keeps a 2 s stall window open for ever: HEAD copied for ever."""
    port, _ = hostile_sshd
    conn = _connector(port, "trickle", tmp_path, connectTimeout=2, **config)
    got, seconds, rss = _attack(_copy_back(conn, port, "/site/job/update", tmp_path / "back"))
    assert isinstance(got, CopyDeadline), got
    assert str(got).startswith("xffl: round timeout: the copy of '/site/job/update'"), got
    assert re.search(why, str(got)), got
    assert seconds < ENDED_WITHIN_S and rss < RSS_BOUND, (seconds, rss >> 20)
