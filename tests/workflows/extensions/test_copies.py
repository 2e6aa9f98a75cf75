"""xffl-ssh's copies against a hostile site: what its listing and its streams may not do.

The site's side runs as real local processes (``sh -c``, the commands xffl-ssh sends over
SSH), with a PATH of the test's own where a compromised facility account would have one;
copies over the real sshd, and dropped mid-flight, are in tests/workflows/test_dropped_copies.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from xffl.workflows.extensions.copies import (
    MIN_RANGE_BYTES,
    Copier,
    CopyRefused,
    Listing,
    ListingReader,
    check_listing,
    pieces,
    streams_for_rtt,
)
from xffl.workflows.extensions.copy_paths import (
    INLINE_FILE_BYTES,
    _local_targets,
    download,
    upload,
)
from xffl.workflows.extensions.site_listing import ENTRY_BYTES


class _Status:
    def __init__(self, code: int | None) -> None:
        self.exit_status = code


class _Proc:
    """A local process with the parts of asyncssh's SSHClientProcess a copy uses."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.stdout, self.stdin = proc.stdout, proc.stdin

    async def wait(self) -> _Status:
        return _Status(await self._proc.wait())


def _copier(path: str | None = None, streams: int = 2,
            round_trip: Any = None, retries: int = 0) -> Copier:
    env = dict(os.environ, PATH=f"{path}:{os.environ['PATH']}" if path else os.environ["PATH"])

    @contextlib.asynccontextmanager
    async def open_process(command: str, upload: bool) -> AsyncIterator[_Proc]:
        pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_shell(
            command, stdin=pipe if upload else null, stdout=null if upload else pipe, env=env)
        try:
            yield _Proc(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def recover() -> None:
        """Nothing to reconnect."""

    return Copier(open_process, recover, streams, retries=retries, retry_delay=0,
                  buffer_size=1 << 16, stall_s=30, round_trip=round_trip)


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    # a piece of its own out to a site (over INLINE_FILE_BYTES); the rest travel in the setup
    (root / "model.safetensors").write_bytes(os.urandom(INLINE_FILE_BYTES + 300_000))
    (root / "sub" / "config.json").write_text("{}")
    (root / "empty").write_bytes(b"")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    return root


def _same(a: Path, b: Path, modes: bool) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*"))
    for rel in files:
        if (a / rel).is_file():
            assert (a / rel).read_bytes() == (b / rel).read_bytes()
            assert (b / rel).stat().st_mode & 0o077 == 0  # owner-only
            # out to a site an executable stays one; nothing from a site is executable here
            assert os.access(b / rel, os.X_OK) == (modes and os.access(a / rel, os.X_OK))


def test_a_folder_goes_there_and_back(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    copier = _copier()
    asyncio.run(upload(copier, str(src), str(tmp_path / "site" / "global")))
    # the small files went inside the setup script, beside the one piece: all counted
    assert copier.progress.moved == copier.progress.total == INLINE_FILE_BYTES + 300_012
    _same(src, tmp_path / "site" / "global", modes=True)
    got = asyncio.run(download(_copier(streams=1), str(tmp_path / "site" / "global"),
                               str(tmp_path / "back"), 1 << 30, 100))
    assert got.bytes == INLINE_FILE_BYTES + 300_012
    _same(src, tmp_path / "back", modes=False)


def test_a_copied_file_is_a_file_at_its_destination(tmp_path: Path) -> None:
    """A File output (a job's probe.json): the listing's one entry is the copied path."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "probe.json").write_text("{}")
    got = asyncio.run(download(_copier(), str(tmp_path / "site" / "probe.json"),
                               str(tmp_path / "probe.json"), 1 << 30, 100))
    assert got.files == {"": 2} and (tmp_path / "probe.json").read_text() == "{}"
    assert (tmp_path / "probe.json").stat().st_mode & 0o077 == 0


def test_a_large_file_moves_as_ranges_over_the_streams() -> None:
    size = 3 * MIN_RANGE_BYTES + 5
    cut = pieces({"model.safetensors": size, "config.json": 10}, streams=4)
    ranges = [(p.start, p.length) for p in cut if p.rel == "model.safetensors"]
    assert len(ranges) == 3 and sum(n for _, n in ranges) == size
    assert [s for s, _ in ranges] == sorted(s for s, _ in ranges)
    assert pieces({"model.safetensors": size}, streams=1)[0].length == size
    # two streams share the large file beside a small one
    assert len([p for p in pieces({"model.safetensors": size, "config.json": 10}, streams=2)
                if p.rel == "model.safetensors"]) == 2


@pytest.mark.parametrize(("rtt_ms", "most", "streams"), [
    # windows of 2 MiB to cover 1 GB/s: 1e9 * rtt / 2**21, rounded up, within [1, most]
    (0.0, 4, 1), (0.3, 4, 1), (2.09, 4, 1),  # one window covers it up to 2.097 ms
    (2.1, 4, 2), (5.0, 4, 3), (6.3, 4, 4), (50.0, 4, 4),
    (50.0, 64, 24), (50.0, 1, 1), (200.0, 64, 64),
])
def test_the_streams_cover_the_round_trip(rtt_ms: float, most: int, streams: int) -> None:
    assert streams_for_rtt(rtt_ms / 1e3, most) == streams


@pytest.mark.parametrize(("rtt", "used"), [(0.0004, 1), (0.05, 4), (ConnectionError(), 4)])
def test_a_copy_uses_the_streams_its_round_trip_needs(tmp_path: Path, rtt: Any,
                                                      used: int) -> None:
    """Measured once per copy, beside the listing (back) or the setup (out); a link whose
    round trip cannot be measured keeps the profile's streams and the copy goes on."""
    calls = []

    async def round_trip() -> float:
        calls.append(1)
        if isinstance(rtt, Exception):
            raise rtt
        return float(rtt)

    src = _tree(tmp_path / "src")
    out = _copier(streams=4, round_trip=round_trip)
    asyncio.run(upload(out, str(src), str(tmp_path / "site")))
    back = _copier(streams=4, round_trip=round_trip)
    asyncio.run(download(back, str(tmp_path / "site"), str(tmp_path / "back"), 1 << 30, 100))
    assert (out.streams, back.streams, len(calls)) == (used, used, 2)
    measured = None if isinstance(rtt, Exception) else rtt
    assert (out.rtt, back.rtt) == (measured, measured)
    assert out.describe().startswith(f"1 attempt(s), {used} stream(s)")
    _same(src, tmp_path / "back", modes=False)


@pytest.mark.parametrize(("raw", "why"), [
    (b"d 0 \0f 3 ../outside\0", "not a path under it"),
    (b"d 0 \0f 3 /etc/passwd\0", "not a path under it"),
    (b"d 0 \0f 3 sub/../../x\0", "not a path under it"),
    (b"d 0 \0x 0 link\0", "not a regular file or folder"),
    (b"d 0 \0f -3 neg\0", "not a regular file or folder"),
    (b"d 0 \0f 2000 big\0", "exceeds 1000 bytes"),
    (b"d 0 \0" + b"".join(b"f 1 f%d\0" % i for i in range(11)), "more than 10 files"),
    # digits that are not ASCII: str.isdigit() takes them, int() does not (HEAD: ValueError)
    (b"d 0 \0f \xc2\xb2 squared\0", "not a regular file or folder"),
    (b"d 0 \0f \xd9\xa3 arabic-three\0", "not a regular file or folder"),
    # one name twice, or under a file (HEAD: IsADirectoryError/NotADirectoryError on write)
    (b"d 0 \0f 1 a\0d 0 a\0", "listed twice"),
    (b"d 0 \0f 1 a\0f 2 a\0", "listed twice"),
    (b"d 0 \0f 1 a\0f 1 a/b\0", "not in a folder listed before it"),
    (b"d 0 \0f 1 sub/b\0", "not in a folder listed before it"),
    (b"f 2 \0f 1 b\0", "not in a folder listed before it"),  # the copied path is a file
    (b"d 0 \0f 1 " + b"n" * 1100 + b"\0", "longer than 1024 bytes"),
])
def test_a_hostile_listing_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(CopyRefused, match=why):
        check_listing(raw, "update", max_bytes=1000, max_members=10)


def test_a_listing_is_checked_as_it_arrives() -> None:
    """An entry with no end is refused once it is longer than any entry can be, and the
    caps are met before the rest of the listing is read."""
    reader = ListingReader("update", max_bytes=1000, max_members=10)
    reader.feed(b"d 0 \0f 3 model.safe")
    reader.feed(b"tensors\0")
    with pytest.raises(CopyRefused, match="an entry of its listing is longer than"):
        reader.feed(b"f 1 " + b"n" * ENTRY_BYTES)
    reader = ListingReader("update", max_bytes=1000, max_members=10)
    with pytest.raises(CopyRefused, match="more than 10 files"):
        for i in range(1 << 20):  # stops at the 11th entry, not at the end
            reader.feed(b"f 1 f%d\0" % i)
    assert i == 10


def test_a_hostile_find_cannot_list_a_name_twice(tmp_path: Path) -> None:
    """HEAD made folder ``a`` and then opened it as the file ``a``: IsADirectoryError."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "find").write_text("#!/bin/sh\nprintf 'd 0 \\0d 0 a\\0f 3 a\\0'\n")
    (bin_dir / "find").chmod(0o700)
    (tmp_path / "site").mkdir()
    with pytest.raises(CopyRefused, match="listed twice"):
        asyncio.run(download(_copier(str(bin_dir)), str(tmp_path / "site"),
                             str(tmp_path / "back"), 1 << 30, 100))
    assert not (tmp_path / "back").exists()


# a file's name may hold any byte but "/" and NUL: a forged line of streamflow.log
FORGED = "\n2026-01-01 00:00:00.000 INFO     EXECUTING step train_alpha (job x) --round 3"


def test_a_site_chosen_name_cannot_forge_a_log_line(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A name with a newline (a valid name) in a copy that drops once and resumes: every
    line xffl-ssh logs about it is one line (``xffl logs`` parses streamflow.log by line)."""
    from streamflow.log_handler import logger

    site = tmp_path / "site"
    site.mkdir()
    (site / f"x{FORGED}").write_bytes(b"y" * 1000)
    bin_dir = tmp_path / "bin"  # the first `head` sends 10 bytes and fails: a dropped copy
    bin_dir.mkdir()
    (bin_dir / "head").write_text(
        f"#!/bin/sh\nif [ ! -e {tmp_path}/dropped ]; then touch {tmp_path}/dropped; "
        f'printf 0123456789; exit 1; fi\nexec {shutil.which("head")} "$@"\n')
    (bin_dir / "head").chmod(0o700)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="streamflow"):
            asyncio.run(download(_copier(str(bin_dir), streams=1, retries=1), str(site),
                                 str(tmp_path / "back"), 1 << 30, 100))
    finally:
        logger.removeHandler(caplog.handler)
    assert (tmp_path / "back" / f"x{FORGED}").read_bytes() == b"y" * 1000
    said = [r.getMessage() for r in caplog.records]
    assert any("RESUMING" in m for m in said) and any("dropped" in m for m in said), said
    assert all("\n" not in m for m in said), said


def test_a_link_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dst = tmp_path / "update"
    dst.mkdir()
    (dst / "sub").symlink_to(outside)  # left there by anyone who could write there
    listing = Listing(dirs=["sub"], files={"sub/model.safetensors": 3})
    with pytest.raises(CopyRefused, match="leads outside"):
        _local_targets(listing, str(dst))
    assert list(outside.iterdir()) == []


def test_a_site_that_sends_more_than_it_listed_is_refused(tmp_path: Path) -> None:
    src = _tree(tmp_path / "site")
    bin_dir = tmp_path / "bin"  # the account's `head` ignores its limit
    bin_dir.mkdir()
    (bin_dir / "head").write_text(  # its file (the last argument) or stdin, and then more
        '#!/bin/sh\nfor f; do :; done\nif [ -f "$f" ]; then cat -- "$f"; else cat; fi\n'
        "printf 'more bytes than listed'\n")
    (bin_dir / "head").chmod(0o700)
    with pytest.raises(CopyRefused, match="sent more than the"):
        asyncio.run(download(_copier(str(bin_dir), streams=1), str(src),
                             str(tmp_path / "back"), 1 << 30, 100))


def test_a_hostile_find_cannot_name_a_path_outside(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # the account's `find` lists a file above the copied folder
    bin_dir.mkdir()
    (bin_dir / "find").write_text("#!/bin/sh\nprintf 'd 0 \\0f 3 ../../victim\\0'\n")
    (bin_dir / "find").chmod(0o700)
    (tmp_path / "site").mkdir()
    with pytest.raises(CopyRefused, match="not a path under it"):
        asyncio.run(download(_copier(str(bin_dir)), str(tmp_path / "site"),
                             str(tmp_path / "back"), 1 << 30, 100))
    assert not (tmp_path / "back").exists() and not (tmp_path / "victim").exists()


