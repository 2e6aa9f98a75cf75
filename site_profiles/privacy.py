"""Whether a site's workdir is private: no other user may write where its jobs leave updates.

Another user who can write the workdir can replace a job's folder, and so the update copied
back from it, before the coordinator reads it. ``xffl submit`` checks every site's workdir
(created 0700 when missing, as ``xffl profiles check`` does) before anything is written.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from xffl.core.errors import ConnectionFailed
from xffl.site_profiles.remote import connect, run
from xffl.site_profiles.schema import SiteProfile, SshConnector


def problem(workdir: str, mode: int, owner: int, me: int) -> str | None:
    """Why ``workdir`` (its permission bits and owner's uid) is not private, or None."""
    if owner != me:
        return (f"{workdir} belongs to another user (uid {owner}), who can replace what "
                "xffl's jobs leave there; give the profile a workdir of your own")
    if mode & 0o022:
        return (f"{workdir} is mode {mode:04o}: other users can replace what xffl's jobs leave "
                f"there; run `chmod go-w {shlex.quote(workdir)}` at the site")
    return None


def _script(workdir: str) -> str:
    """Create ``workdir`` owner-only if missing; print its mode (octal), its owner and ours."""
    w = shlex.quote(workdir)
    return f"mkdir -p -m 700 {w} && stat -c '%a %u' {w} && id -u"


def _remote(site: str, profile: SiteProfile, workdir: str) -> str | None:
    """The problem of an SSH site's workdir, read over a verified connection."""
    with connect(profile) as client:
        rc, out, err = run(client, _script(workdir))
    words = out.split()
    if rc != 0 or len(words) < 3 or not set(words[-3]) <= set("01234567") \
            or not words[-2].isdigit() or not words[-1].isdigit():
        raise ConnectionFailed(
            f"site {site!r}: cannot create or read the workdir {workdir} "
            f"({(err.strip().splitlines() or [f'exit {rc}'])[-1]}); check workdir in the "
            f"profile and `xffl profiles check {profile.name}`.")
    return problem(workdir, int(words[-3], 8), int(words[-2]), int(words[-1]))


def _local(workdir: str) -> str | None:
    """The problem of a workdir on this machine."""
    path = Path(workdir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    return problem(workdir, st.st_mode & 0o7777, st.st_uid, os.getuid())


def check_workdir(site: str, profile: SiteProfile, workdir: str) -> None:
    """ConnectionFailed (exit 3) unless ``site``'s ``workdir`` is private, at the site."""
    found = (_remote(site, profile, workdir) if isinstance(profile.connector, SshConnector)
             else _local(workdir))
    if found is not None:
        raise ConnectionFailed(f"site {site!r}: its workdir is not private: {found}.")
