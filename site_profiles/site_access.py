"""Commands and file copies at a site for `xffl profiles install`: over the profile's own
verified SSH login (:mod:`.remote`), or on this machine for a local site."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import paramiko

from xffl.site_profiles.schema import SiteProfile, SshConnector


class Site:
    """One site's shell (its profile's setup lines run first) and its filesystem."""

    def __init__(self, profile: SiteProfile, client: paramiko.SSHClient | None) -> None:
        self.profile = profile
        self.client = client
        self._sftp: paramiko.SFTPClient | None = None

    def run(self, command: str, timeout: float = 120.0,
            setup: bool = True) -> tuple[int, str, str]:
        """Run ``command`` in the site's shell (after the profile's setup lines: the module
        that brings its Python); (exit status, stdout, stderr)."""
        if setup and self.profile.setup:
            command = "\n".join([*self.profile.setup, command])
        if self.client is None:
            try:
                proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                                      timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                return 124, "", f"timed out after {timeout:.0f} s"
            return proc.returncode, proc.stdout, proc.stderr
        from xffl.site_profiles.remote import run

        return run(self.client, f"sh -c {shlex.quote(command)}", timeout)

    def put(self, local: Path, remote: str) -> None:
        """Copy ``local`` to ``remote`` at the site (a partial copy never has that name)."""
        part = f"{remote}.part"
        if self.client is None:
            shutil.copyfile(local, part)
            Path(part).rename(remote)
            return
        if self._sftp is None:
            self._sftp = self.client.open_sftp()
        self._sftp.put(str(local), part)
        self._sftp.posix_rename(part, remote)

    def sizes(self, folder: str) -> dict[str, int]:
        """The files of ``folder`` at the site and their sizes (empty when it is missing)."""
        rc, out, _ = self.run(f"cd {shlex.quote(folder)} 2>/dev/null && "
                              "find . -maxdepth 1 -type f -printf '%f %s\\n'", setup=False)
        found: dict[str, int] = {}
        for line in out.splitlines() if rc == 0 else ():
            name, _, size = line.rpartition(" ")
            if name and size.isdigit():
                found[name] = int(size)
        return found

    def close(self) -> None:
        """Close the SFTP session and the connection."""
        if self._sftp is not None:
            self._sftp.close()
        if self.client is not None:
            self.client.close()


@contextmanager
def open_site(profile: SiteProfile) -> Iterator[Site]:
    """The site of ``profile``: one verified SSH login (every failure ConnectionFailed, exit
    3), or this machine for a local profile."""
    client = None
    if isinstance(profile.connector, SshConnector):
        from xffl.site_profiles.remote import connect

        client = connect(profile)
    site = Site(profile, client)
    try:
        yield site
    finally:
        site.close()
