"""The two directions of an xffl-ssh copy: a site's path to the coordinator, and back out.

Both move :class:`~xffl.workflows.extensions.copies.Piece` s through a
:class:`~xffl.workflows.extensions.copies.Copier` (parallel channels, resumed after a drop);
see :mod:`xffl.workflows.extensions.copies` for the commands run at the site.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import posixpath
import shlex

from xffl.workflows.extensions.copies import (
    UPLOAD_SLACK_BYTES,
    Copier,
    CopyInterrupted,
    CopyRefused,
    Listing,
    ListingReader,
    Piece,
    closing_fds,
    join,
    listing_bytes,
    local_listing,
    local_sha256,
    pieces,
    remote_sha256,
)

# regular files and folders as themselves, anything else as 'x' (refused); links followed,
# as upstream's `tar chf` follows them; NUL-separated: a name may hold any other byte
FIND = (r"find -L {src} \( -type d -printf 'd 0 %P\0' \) -o \( -type f -printf 'f %s %P\0' \)"
        r" -o -printf 'x 0 %P\0'")
_NOFOLLOW_WRITE = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
# a file out to a site this small travels inside the setup script (a checkpoint's JSON files)
INLINE_FILE_BYTES = 1 << 20
INLINE_TOTAL_BYTES = 4 << 20
_END = "XFFL_END_OF_FILE"
FOLDER_ANSWER_BYTES = 64  # "folder\n", or nothing


def _inside(path: str, real_dst: str) -> bool:
    """Whether ``path``, its links resolved on disk, is ``real_dst`` or under it."""
    return os.path.commonpath([os.path.realpath(path), real_dst]) == real_dst


def _local_targets(listing: Listing, dst: str) -> dict[str, str]:
    """Make ``dst``'s folders (owner-only) and return each file's local path; a folder on the
    way that a link leads out of ``dst`` is refused before anything is written there."""
    if "" in listing.files:  # the copied path is a file: dst is its name (StreamFlow's)
        return {"": dst}
    os.makedirs(dst, mode=0o700, exist_ok=True)
    real_dst = os.path.realpath(dst)
    for rel in sorted(listing.dirs, key=lambda d: d.count("/")):
        target = os.path.join(real_dst, *rel.split("/"))
        if not _inside(os.path.dirname(target), real_dst):
            raise CopyRefused(f"refused to copy {rel!r}: a link on its way leads outside {dst}")
        os.makedirs(target, mode=0o700, exist_ok=True)
        if not _inside(target, real_dst):
            raise CopyRefused(f"refused to copy {rel!r}: a link on its way leads outside {dst}")
    out = {}
    for rel in listing.files:
        target = os.path.join(real_dst, *rel.split("/"))
        if not _inside(os.path.dirname(target), real_dst):
            raise CopyRefused(f"refused to copy {rel!r}: a link on its way leads outside {dst}")
        out[rel] = target
    return out


async def download(copier: Copier, src: str, dst: str, max_bytes: int,
                   max_members: int) -> Listing:
    """Copy the site's ``src`` (a file or folder) to the local ``dst``; return its listing."""
    what = f"{src!r} from the site"
    # the listing is checked as it arrives, and read no further than its caps allow
    cap = listing_bytes(max_members)
    copier.limit(cap, what)

    listed_bytes = 0

    async def listed() -> Listing:
        nonlocal listed_bytes
        reader = ListingReader(src, max_bytes, max_members)
        listed_bytes = await copier.stream(FIND.format(src=shlex.quote(src)), reader.feed, cap)
        return reader.finish()

    # the round trip is measured beside the listing (it sets how many streams the copy uses)
    listing: Listing = (await asyncio.gather(copier.retrying(what, listed),
                                             copier.fit_streams()))[0]
    copier.limit(listed_bytes + listing.bytes, what)  # the copy's own bytes, listing included
    targets = _local_targets(listing, dst)
    todo = pieces(listing.files, copier.streams)
    async with closing_fds(targets, _NOFOLLOW_WRITE) as fds:

        async def move(p: Piece) -> None:
            if p.length == 0:
                return
            fd, pos = fds[p.rel], p.start + p.done
            left, path = p.length - p.done, shlex.quote(join(src, p.rel))
            # one process at the site where the piece starts at the file's start
            command = f"head -c {left} -- {path}" if pos == 0 else \
                f"tail -c +{pos + 1} -- {path} | head -c {left}"
            async with copier.open_process(command, False) as proc:
                while p.done < p.length:
                    # what has arrived (asyncssh's readexactly costs 2.5x the CPU per GB)
                    chunk = await copier.bounded(proc.stdout.read(copier.buffer_size))
                    if not chunk:
                        break
                    if len(chunk) > p.length - p.done:
                        raise CopyRefused(f"refused to copy {join(src, p.rel)!r}: the site "
                                          f"sent more than the {listing.files[p.rel]} bytes "
                                          "it listed")
                    os.pwrite(fd, chunk, p.start + p.done)
                    p.done += len(chunk)
                    copier.progress.moved += len(chunk)
                if p.done == p.length and await copier.bounded(proc.stdout.read(1)):
                    raise CopyRefused(f"refused to copy {join(src, p.rel)!r}: the site sent "
                                      f"more than the {listing.files[p.rel]} bytes it listed")
                status = await copier.bounded(proc.wait())
            if p.done < p.length:
                raise CopyInterrupted(f"{join(src, p.rel)!r}: {p.done} of {p.length} bytes of "
                                      f"a piece arrived (exit {status.exit_status})")

        async def verify(p: Piece) -> None:
            here = local_sha256(fds[p.rel], p.start, p.done)
            there = await remote_sha256(copier, join(src, p.rel), p.start, p.done)
            if here != there:
                copier.progress.moved -= p.done
                p.done = 0

        await copier.run(what, todo, move, verify)
    return listing


def _inline(listing: Listing) -> list[str]:
    """The files small enough to travel inside the setup script (the JSON files of a
    checkpoint), at most ``INLINE_TOTAL_BYTES`` in all: no channel of their own, whose
    opening and closing cost more round trips than their bytes."""
    out, total = [], 0
    for rel, size in sorted(listing.files.items(), key=lambda kv: kv[1]):
        if size > INLINE_FILE_BYTES or total + size > INLINE_TOTAL_BYTES:
            break
        out.append(rel)
        total += size
    return out


def _setup_script(listing: Listing, dst: str, executable: list[str],
                  inline: dict[str, bytes]) -> str:
    """The sh script that makes ``dst``'s folders, sizes its files and writes the
    ``inline`` ones (base64 in a here-document), owner-only (the ``executable`` ones 0700, as
    upstream's ``tar xpf`` keeps a mode)."""
    q = shlex.quote
    lines = ["set -e", "umask 077",
             f"mkdir -p -- {q(posixpath.dirname(dst) or '/')}"]
    if "" not in listing.files:
        lines.append(f"mkdir -p -- {q(dst)}")
    lines += [f"mkdir -p -- {q(join(dst, d))}" for d in sorted(listing.dirs)]
    lines += [f"truncate -s {size} -- {q(join(dst, rel))}"
              for rel, size in listing.files.items() if rel not in inline]
    for rel, data in inline.items():  # base64 never holds the line that ends it
        lines += [f"base64 -d > {q(join(dst, rel))} <<'{_END}'",
                  base64.encodebytes(data).decode("ascii").rstrip("\n"), _END]
    lines += [f"chmod 700 -- {q(join(dst, rel))}" for rel in executable]
    return "\n".join(lines) + "\n"


async def destination(copier: Copier, src: str, dst: str) -> str:
    """Where the copy of ``src`` goes: ``dst/basename(src)`` when ``dst`` is a folder at the
    site, else ``dst`` (upstream's ``get_local_to_remote_destination``, asked on a channel
    of its own rather than through the persistent shell: a round trip, not a shell start)."""
    what = f"{src!r} to {dst!r} at the site"
    copier.limit(FOLDER_ANSWER_BYTES, what)
    out = await copier.retrying(what, lambda: copier.output(
        f"if test -d {shlex.quote(dst)}; then echo folder; fi", FOLDER_ANSWER_BYTES))
    return posixpath.join(dst, os.path.basename(src)) if out.strip() == b"folder" else dst


async def upload(copier: Copier, src: str, dst: str) -> Listing:
    """Copy the local ``src`` (a file or folder) to the site's ``dst``; return its listing.

    The setup script (folders, sizes, the small files) runs beside the pieces: each piece
    makes its own folder first."""
    what = f"{src!r} to {dst!r} at the site"
    listing = local_listing(src)
    copier.limit(listing.bytes, what)
    paths = {rel: os.path.join(src, *rel.split("/")) if rel else src for rel in listing.files}
    executable = [rel for rel, path in paths.items() if os.stat(path).st_mode & 0o100]
    inline = {}
    for rel in _inline(listing):
        with open(paths[rel], "rb") as f:
            inline[rel] = f.read(INLINE_FILE_BYTES + 1)
        if len(inline[rel]) != listing.files[rel]:
            raise CopyInterrupted(f"{paths[rel]} changed size while it was copied")
    script = _setup_script(listing, dst, executable, inline).encode()

    async def setup() -> None:
        async with copier.open_process("sh -s", True) as proc:
            proc.stdin.write(script)
            proc.stdin.write_eof()
            status = await copier.bounded(proc.wait())
        if status.exit_status != 0:
            raise CopyInterrupted(f"making the folders of {dst} exited {status.exit_status}")
        copier.progress.moved += sum(map(len, inline.values()))

    made = asyncio.ensure_future(copier.retrying(what, setup))
    await copier.fit_streams()  # beside the setup script
    todo = pieces({r: n for r, n in listing.files.items() if r not in inline}, copier.streams)
    async with closing_fds({p.rel: paths[p.rel] for p in todo}, os.O_RDONLY) as fds:

        async def move(p: Piece) -> None:
            if p.length == 0:
                return
            fd, pos = fds[p.rel], p.start + p.done
            target = join(dst, p.rel)  # its folder may not be made yet: the setup is beside
            command = (f"umask 077 && mkdir -p -- {shlex.quote(posixpath.dirname(target))} && "
                       f"exec dd of={shlex.quote(target)} bs=4M seek={pos} oflag=seek_bytes "
                       "conv=notrunc status=none")
            async with copier.open_process(command, True) as proc:
                while p.done < p.length:
                    chunk = os.pread(fd, min(copier.buffer_size, p.length - p.done),
                                     p.start + p.done)
                    if not chunk:
                        raise CopyInterrupted(f"{paths[p.rel]} shrank while it was copied")
                    proc.stdin.write(chunk)
                    await copier.bounded(proc.stdin.drain())
                    p.done += len(chunk)
                    copier.progress.moved += len(chunk)
                proc.stdin.write_eof()
                status = await copier.bounded(proc.wait())
            if status.exit_status != 0:
                raise CopyInterrupted(f"writing {join(dst, p.rel)} at the site exited "
                                      f"{status.exit_status}")

        async def verify(p: Piece) -> None:
            # what was sent but not yet written there when the link dropped is not known:
            # back off by what can be in flight, and keep the rest only if it is equal
            keep = max(0, p.done - UPLOAD_SLACK_BYTES)
            same = keep > 0 and local_sha256(fds[p.rel], p.start, keep) == \
                await remote_sha256(copier, join(dst, p.rel), p.start, keep)
            copier.progress.moved -= p.done - (keep if same else 0)
            p.done = keep if same else 0

        try:
            await copier.run(what, todo, move, verify, beside=sum(map(len, inline.values())))
            await made
        finally:
            made.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await made
    return listing
