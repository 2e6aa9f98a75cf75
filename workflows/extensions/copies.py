"""xffl-ssh's copies: files over several SSH channels, resumed after a dropped connection.

StreamFlow 0.2.0rc3 copies a folder as one ``tar`` stream over one SSH channel: one stream
is bound by the channel window over the round-trip time, and a dropped connection fails
the whole copy (and with it the site's step). Here a copy is a list of *pieces* (a file, or
a byte range of a large one) that move over ``streams`` concurrent channels:

* site -> coordinator: one ``find`` lists the copied path (``f SIZE NAME``/``d 0 NAME``,
  NUL-separated); the list is checked before anything is written (:func:`check_listing`:
  regular files and folders under the copied path only, within the copy's caps); each
  piece is then ``head -c LENGTH FILE`` (``tail -c +START FILE | head -c LENGTH`` from
  within the file), written at its offset into a file
  created without following links, and never longer than the listing said;
* coordinator -> site: one ``sh -s`` script makes the folders, sizes the files and carries
  the small ones (a checkpoint's JSON files, base64) (``umask 077``), beside the pieces,
  each written by ``dd ... seek=START oflag=seek_bytes conv=notrunc`` once its folder is
  made (every remote command costs round trips and a login's start: the small files would
  otherwise cost one each, and a one-stream copy waits for them in turn).

When a channel or the connection drops (a killed sshd, a reset link), each unfinished piece
is resumed from what arrived, once the prefix is shown equal on both sides (SHA-256 of
``head -c`` at the site against the local bytes; otherwise the piece starts again from 0),
after ``retry_delay`` seconds, at most ``retries`` times in one copy. Only then does the copy
fail, with the reason. Nothing of this decides what is admitted: the coordinator checks an
update's manifest checksums after the copy, as before.

The site is not trusted to stop talking: every answer of a short command is read as it
arrives, with a byte cap (:meth:`Copier.stream`: the listing's from the copy's member cap,
``SHA256_ANSWER_BYTES`` for ``sha256sum``), and every copy has an overall deadline
(:meth:`Copier.limit`) beside the stall timeout, so a site that trickles a byte per stall
window fails instead of holding the round. Names the site chose are logged as ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import posixpath
import re
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncssh
from streamflow.core.exception import WorkflowExecutionException
from streamflow.log_handler import logger

from xffl.workflows.extensions.failure import TIMEOUT_MARK
from xffl.workflows.extensions.site_listing import (
    CopyRefused,
    Listing,
    ListingReader,
    check_listing,
    listing_bytes,
)

__all__ = ["CopyRefused", "Listing", "ListingReader", "check_listing", "listing_bytes"]

# a large file is cut into ranges of at least this many bytes when there are spare streams
MIN_RANGE_BYTES = 64 << 20
# bytes that may have been sent to a site but not written there when a connection dropped:
# sshd's channel window (OpenSSH: 2 MiB), asyncssh's write buffer and the pipe to dd (64 KiB
# each); a resumed upload backs off this far, and keeps even that only if its SHA-256 matches
UPLOAD_SLACK_BYTES = 8 << 20
# One SSH channel moves at most one window of bytes per round trip. The smaller window a copy
# meets is sshd's receive window (OpenSSH's 2 MiB, which a client cannot change; copies back
# take ours, 16 MiB), and one channel's encryption moves about 0.8 GB/s on one core of this
# project's machines: a copy uses as many channels as it takes for their windows to cover
# STREAM_RATE: one up to 2.1 ms round trip, two up to 4.2 ms, the default 4 from 6.3 ms on.
# Below that, channels add processes at the site and the coordinator and move nothing more:
# on loopback 4 channels copied a 1 GiB file back at 0.57x one channel (bench/transfer).
STREAM_WINDOW = 2 << 20
STREAM_RATE = 1e9
# A copy's overall deadline (Copier.limit) allows its bytes at this rate (8 Mb/s, a slow
# facility's link), beside one stall window and retry delay per attempt, and never more than
# the job's round time limit: a site that sends a byte just inside each stall window fails.
COPY_MIN_RATE = 1e6
# what the site may answer to the short commands of a copy: `sha256sum` prints 64 hex
# digits, two spaces, "-" and a newline (69 bytes); a folder test prints "folder\n"
SHA256_ANSWER_BYTES = 128
OUTPUT_CHUNK = 1 << 16
_SHA256_HEX = re.compile(rb"[0-9a-f]{64}")


def streams_for_rtt(rtt_s: float, most: int) -> int:
    """Channels whose windows cover STREAM_RATE at round trip ``rtt_s``, 1 to ``most``."""
    return max(1, min(most, math.ceil(rtt_s * STREAM_RATE / STREAM_WINDOW)))


T = TypeVar("T")


class CopyInterrupted(Exception):
    """A piece's stream ended early, or its remote command failed: worth another attempt."""


# what a dropped connection, channel or remote command looks like to the copying side
RETRYABLE = (CopyInterrupted, asyncssh.Error, ConnectionError, asyncio.IncompleteReadError,
             TimeoutError)


class CopyDeadline(WorkflowExecutionException):
    """A copy still moving at its overall deadline (see :meth:`Copier.limit`): not retried."""


@dataclass
class Piece:
    """Bytes ``[start, start + length)`` of the file ``rel`` (under the copied path)."""

    rel: str
    start: int
    length: int
    done: int = 0  # bytes of this piece known to be at the destination


def local_listing(src: str) -> Listing:
    """The listing of a local file or folder (links followed, as ``tar h`` does)."""
    if not os.path.isdir(src):
        return Listing(files={"": os.path.getsize(src)})
    out = Listing()
    for folder, dirs, names in os.walk(src, followlinks=True):
        rel = os.path.relpath(folder, src)
        base = "" if rel == "." else rel
        out.dirs.extend(posixpath.join(base, d) for d in dirs)
        for n in names:
            out.files[posixpath.join(base, n)] = os.path.getsize(os.path.join(folder, n))
    return out


def pieces(files: dict[str, int], streams: int) -> list[Piece]:
    """The pieces of a copy, largest first: a file per piece, a file of at least twice
    MIN_RANGE_BYTES cut into up to ``streams`` ranges (the streams then share its bytes
    whatever else the copy holds: a checkpoint is one large file and a few small ones)."""
    out: list[Piece] = []
    for rel, size in sorted(files.items(), key=lambda kv: -kv[1]):
        cuts = max(1, min(streams, size // MIN_RANGE_BYTES))
        step = max(1, -(-size // cuts))
        out.extend(Piece(rel, s, min(step, size - s)) for s in range(0, size, step))
        if size == 0:
            out.append(Piece(rel, 0, 0))
    return out


def join(root: str, rel: str) -> str:
    """``root/rel`` (``root`` itself for the empty name)."""
    return posixpath.join(root, rel) if rel else root


Open = Callable[..., contextlib.AbstractAsyncContextManager[Any]]


@dataclass
class Progress:
    """Bytes moved so far by one copy, for whoever reports it."""

    total: int = 0
    moved: int = 0
    started: float = field(default_factory=time.monotonic)
    attempts: int = 1


class Copier:
    """One copy's pieces, moved over ``streams`` channels and resumed up to ``retries`` times.

    ``open_process(command, upload)`` opens a remote command (stdin a pipe when ``upload``)
    as an asyncssh process; ``recover()`` is awaited after a drop (it drops dead
    connections so that the next channel reconnects).
    """

    def __init__(self, open_process: Open, recover: Callable[[], Any], streams: int,
                 retries: int, retry_delay: float, buffer_size: int,
                 stall_s: float = 60.0,
                 round_trip: Callable[[], Awaitable[float]] | None = None,
                 timeout_s: float | None = None, min_rate: float = COPY_MIN_RATE) -> None:
        """A copier with the given channels and retry policy; a stream that moves nothing
        for ``stall_s`` seconds counts as dropped (a link can die without a word).

        ``round_trip()``, when given, measures the link's round trip in seconds; the copy
        then uses :func:`streams_for_rtt` of it (at most ``streams``). ``timeout_s`` and
        ``min_rate`` (bytes/s) set the copy's overall deadline (:meth:`limit`).
        """
        self.stall_s = stall_s
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.deadline: float | None = None  # time.monotonic() at which the copy has failed
        self.budget = math.inf
        self.what = self.why = ""
        self.round_trip = round_trip
        self.rtt: float | None = None
        self.open_process = open_process
        self.recover = recover
        self.streams = max(1, streams)
        self.retries = retries
        self.retry_delay = retry_delay
        self.buffer_size = buffer_size
        self.progress = Progress()

    async def bounded(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``, or TimeoutError after ``stall_s`` seconds without its result;
        :class:`CopyDeadline` once the copy's deadline (:meth:`limit`) has passed."""
        if self.deadline is None:
            return await asyncio.wait_for(awaitable, self.stall_s)
        # checked before each wait too: a read of bytes already there never lets a timeout in
        left = self.deadline - time.monotonic()
        if left <= 0:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise self.late()
        try:
            return await asyncio.wait_for(awaitable, min(self.stall_s, left))
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise self.late() from None
            raise

    def late(self) -> CopyDeadline:
        """The failure of a copy past its deadline."""
        return CopyDeadline(f"{TIMEOUT_MARK}: the copy of {self.what} was still moving after "
                            f"{self.budget:.0f} s, its deadline ({self.why})")

    def limit(self, nbytes: int, what: str) -> None:
        """Give the copy (of ``what``) an overall deadline from its start: ``nbytes`` at
        ``min_rate`` plus a stall window and a retry delay per attempt, never more than
        ``timeout_s`` (the round's); a site that trickles a byte per stall window is cut
        off there, not held for ever."""
        attempts = self.retries + 1
        budget = attempts * (self.stall_s + self.retry_delay) + nbytes / self.min_rate
        self.why = (f"{nbytes} bytes at {self.min_rate / 1e6:g} MB/s and {attempts} "
                    f"attempt(s) of {self.stall_s:g} s")
        if self.timeout_s is not None and self.timeout_s < budget:
            budget, self.why = self.timeout_s, "the round's time limit"
        self.what, self.budget = what, budget
        self.deadline = self.progress.started + budget

    async def fit_streams(self) -> None:
        """Set ``streams`` to what this copy uses: fewer where the round trip is short
        (measured once; a link that does not answer keeps ``streams``, and the copy finds
        out itself)."""
        if self.round_trip is None or self.rtt is not None:
            return
        try:
            self.rtt = await self.bounded(self.round_trip())
        except RETRYABLE as exc:
            logger.warning(f"no round trip measured ({type(exc).__name__}: {exc}): "
                           f"{self.streams} stream(s)")
            return
        self.streams = streams_for_rtt(self.rtt, self.streams)

    def describe(self) -> str:
        """``2 attempt(s), 4 stream(s), round trip 50.3 ms`` (for the log)."""
        rtt = "" if self.rtt is None else f", round trip {self.rtt * 1e3:.1f} ms"
        return f"{self.progress.attempts} attempt(s), {self.streams} stream(s){rtt}"

    async def stream(self, command: str, take: Callable[[bytes], object],
                     max_bytes: int) -> int:
        """Hand the stdout of a command at the site to ``take`` as it arrives (it must exit
        0); more than ``max_bytes`` is refused, and no more of it is read. Its bytes."""
        got = 0
        async with self.open_process(command, False) as proc:
            while chunk := await self.bounded(proc.stdout.read(OUTPUT_CHUNK)):
                got += len(chunk)
                if got > max_bytes:
                    raise CopyRefused(f"refused the answer of {command[:80]!r}: more than "
                                      f"{max_bytes} bytes")
                take(chunk)
            status = await self.bounded(proc.wait())
        if status.exit_status != 0:
            raise CopyInterrupted(f"{command[:80]!r} exited {status.exit_status}")
        return got

    async def output(self, command: str, max_bytes: int) -> bytes:
        """The stdout of a short command at the site (it must exit 0), at most
        ``max_bytes`` of it (more is refused)."""
        data = bytearray()
        await self.stream(command, data.extend, max_bytes)
        return bytes(data)

    async def retrying(self, what: str, attempt: Callable[[], Any]) -> Any:
        """``attempt()``, again after each dropped connection, at most ``retries`` more times."""
        for n in range(self.retries + 1):
            try:
                return await attempt()
            except RETRYABLE as exc:
                if n == self.retries:
                    raise WorkflowExecutionException(
                        f"FAILED copy of {what} after {n + 1} attempt(s): "
                        f"{type(exc).__name__}: {exc}") from exc
                self.progress.attempts += 1
                logger.warning(f"copy of {what} dropped ({type(exc).__name__}: {exc}); "
                               f"attempt {n + 2} of {self.retries + 1} in "
                               f"{self.retry_delay:g} s")
                await asyncio.sleep(self.retry_delay)
                await self.recover()
        raise AssertionError("unreachable")

    async def run(self, what: str, todo: Sequence[Piece],
                  move: Callable[[Piece], Any], verify: Callable[[Piece], Any],
                  beside: int = 0) -> None:
        """Move every piece; after a drop, verify each started piece's prefix, then go on
        (``beside``: bytes of the same copy that move otherwise, counted in its total)."""
        self.progress.total = sum(p.length for p in todo) + beside
        first = True

        async def attempt() -> None:
            nonlocal first
            if not first:
                for p in todo:
                    if 0 < p.done < p.length:
                        await verify(p)
                        logger.info(f"RESUMING copy of {what}: {p.rel or '.'!r} bytes "
                                    f"{p.start}+{p.length} from {p.start + p.done}")
            first = False
            gate = asyncio.Semaphore(self.streams)

            async def one(p: Piece) -> None:
                async with gate:
                    if p.done < p.length or p.length == 0:
                        await move(p)

            tasks = [asyncio.ensure_future(one(p)) for p in todo]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        await self.retrying(what, attempt)


async def remote_sha256(copier: Copier, path: str, start: int, length: int) -> str:
    """The SHA-256 of bytes ``[start, start + length)`` of ``path`` at the site (hex; ""
    when the site's answer is no such line, which matches no prefix)."""
    out = await copier.output(f"tail -c +{start + 1} {shlex.quote(path)} | head -c {length} "
                              "| sha256sum", SHA256_ANSWER_BYTES)
    digest = out.split(b" ")[0]
    return digest.decode("ascii") if _SHA256_HEX.fullmatch(digest) else ""


def local_sha256(fd: int, start: int, length: int) -> str:
    """The SHA-256 of bytes ``[start, start + length)`` of the open file ``fd``."""
    h = hashlib.sha256()
    pos, end = start, start + length
    while pos < end:
        chunk = os.pread(fd, min(8 << 20, end - pos), pos)
        if not chunk:
            break
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()


@contextlib.asynccontextmanager
async def closing_fds(paths: dict[str, str], flags: int) -> AsyncIterator[dict[str, int]]:
    """Open each local path (``rel -> path``) with ``flags``; close them all at the end."""
    fds: dict[str, int] = {}
    try:
        for rel, path in paths.items():
            fds[rel] = os.open(path, flags, 0o600)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)
