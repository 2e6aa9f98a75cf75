"""A site's listing of a copied path, checked entry by entry as it arrives.

A copy back from a site starts with ``find -L SRC ... -printf 'KIND SIZE NAME\\0'`` run by
the facility's account, whose ``find`` may print anything. :class:`ListingReader` takes the
output a chunk at a time and refuses (:class:`CopyRefused`) the first entry that is not a
regular file or folder under the copied path, a name over ``MAX_NAME_BYTES``, a size that is
not ASCII digits, a name listed twice or under something not listed as a folder, or one
entry, or one byte, more than the copy's caps: nothing beyond one entry is held before it is
checked, so what a listing costs the coordinator is bounded by the caps, not by what the
site sends (:func:`listing_bytes`).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from streamflow.core.exception import WorkflowExecutionException

# a name in a copy is relative to the copied path (a checkpoint's are under 64 bytes);
# longer is refused: it bounds what one entry, and so one listing, costs
MAX_NAME_BYTES = 1024
# "f " + a size of at most 20 digits + " " + the name + NUL
ENTRY_BYTES = 2 + 20 + 1 + MAX_NAME_BYTES + 1
_SIZE = re.compile(rb"[0-9]{1,20}")


class CopyRefused(WorkflowExecutionException):
    """The site listed or sent something that a copy never holds."""


def listing_bytes(max_members: int) -> int:
    """The most bytes a listing of at most ``max_members`` entries can take: the byte cap
    of reading one."""
    return max_members * ENTRY_BYTES


@dataclass
class Listing:
    """The folders and files (relative names, sizes) of one copy."""

    dirs: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        """The bytes of all files."""
        return sum(self.files.values())


class ListingReader:
    """Checks a ``find -printf 'KIND SIZE NAME\\0'`` listing chunk by chunk (see module doc)."""

    def __init__(self, what: str, max_bytes: int, max_members: int) -> None:
        """A reader for the listing of ``what``, within the copy's caps."""
        self.what, self.max_bytes, self.max_members = what, max_bytes, max_members
        self.listing = Listing()
        self._rest = b""
        self._entries = 0
        self._bytes = 0
        self._folders = {""}  # where a listed name may be: under the copied folder
        self._seen: set[str] = set()

    def feed(self, chunk: bytes) -> None:
        """Check the entries that ``chunk`` completes; keep the unfinished one."""
        *done, self._rest = (self._rest + chunk).split(b"\0")
        for entry in done:
            if entry:
                self._entry(entry)
        if len(self._rest) > ENTRY_BYTES:
            raise CopyRefused(f"refused to copy {self.what!r}: an entry of its listing is "
                              f"longer than {ENTRY_BYTES} bytes")

    def finish(self) -> Listing:
        """The checked listing, once the whole output was fed."""
        if self._rest:
            self._entry(self._rest)
            self._rest = b""
        return self.listing

    def _entry(self, entry: bytes) -> None:
        self._entries += 1
        if self._entries > self.max_members:  # the copied path's own entry counts
            raise CopyRefused(f"refused to copy {self.what!r}: it holds more than "
                              f"{self.max_members} files and folders")
        if len(entry) > ENTRY_BYTES:
            raise CopyRefused(f"refused to copy {self.what!r}: a name of its listing is "
                              f"longer than {MAX_NAME_BYTES} bytes")
        kind, size, raw = [*entry.split(b" ", 2), b"", b""][:3]
        name = raw.decode("utf-8", "surrogateescape")
        parts = name.split("/")
        if name.startswith("/") or (any(p in ("", ".", "..") for p in parts) and name != ""):
            raise CopyRefused(f"refused to copy {name!r} of {self.what!r}: not a path under it")
        if name in self._seen:
            raise CopyRefused(f"refused to copy {name!r} of {self.what!r}: listed twice")
        if name and posixpath.dirname(name) not in self._folders:
            raise CopyRefused(f"refused to copy {name!r} of {self.what!r}: not in a folder "
                              "listed before it")
        self._seen.add(name)
        if kind == b"d":
            self._folders.add(name)
            if name:
                self.listing.dirs.append(name)
        elif kind == b"f" and _SIZE.fullmatch(size):
            if name == "":  # the copied path is a file: nothing else is under it
                self._folders.discard("")
            self.listing.files[name] = int(size)
            self._bytes += int(size)
            if self._bytes > self.max_bytes:
                raise CopyRefused(f"refused to copy {self.what!r}: it exceeds "
                                  f"{self.max_bytes} bytes")
        else:
            raise CopyRefused(f"refused to copy {name!r} of {self.what!r}: not a regular file "
                              "or folder")


def check_listing(raw: bytes, what: str, max_bytes: int, max_members: int) -> Listing:
    """The whole listing ``raw``, checked as :class:`ListingReader` checks one as it comes."""
    reader = ListingReader(what, max_bytes, max_members)
    reader.feed(raw)
    return reader.finish()
