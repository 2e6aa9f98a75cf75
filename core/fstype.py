"""Which filesystem a path lives on, for what must not run on a network filesystem.

SQLite's write-ahead log needs shared memory between every process that opens the database,
which a network filesystem (an NFS home on a login node, Lustre, GPFS, ...) does not give:
there, WAL can corrupt the registry. The mount table (``/proc/self/mountinfo``) tells.
"""

from __future__ import annotations

import os
from pathlib import Path

NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs",
    "fuse.glusterfs", "glusterfs", "afs", "9p", "panfs", "orangefs", "pvfs2", "ocfs2", "gfs2",
})
MOUNTINFO = Path("/proc/self/mountinfo")


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return field.encode().decode("unicode_escape")


def filesystem_type(path: Path, mountinfo: Path | None = None) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on."""
    target = Path(path).absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    target = Path(os.path.realpath(target))
    try:
        lines = (mountinfo or MOUNTINFO).read_text().splitlines()
    except OSError:
        return None
    best, best_type = "", None
    for line in lines:  # "ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [TAGS] - FSTYPE SOURCE ..."
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        point = _unescape(fields[4])
        inside = target == Path(point) or Path(point) in target.parents
        if inside and len(point) >= len(best):
            best, best_type = point, tail.split()[0]
    return best_type


def on_network_filesystem(path: Path, mountinfo: Path | None = None) -> bool:
    """Whether ``path`` is on a network or cluster filesystem."""
    kind = filesystem_type(path, mountinfo)
    return kind is not None and (kind in NETWORK_FILESYSTEMS or kind.split(".")[0] == "nfs")
