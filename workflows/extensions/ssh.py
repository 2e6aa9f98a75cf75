"""StreamFlow's SSH connector for an untrusted facility: ``xffl-ssh``.

What StreamFlow 0.2.0rc3's ``SSHConnector`` does that an untrusted facility could abuse, and
what this subclass (registered by xffl's StreamFlow plugin) does instead:

* a copy from the site is a tar stream that ``streamflow.deployment.connector.base.
  extract_tar_stream`` extracts with no member filter: names with ``..`` or absolute names
  land outside the destination, links and devices are created as they come. Here a copy is
  not a tar stream: :mod:`xffl.workflows.extensions.copies` moves a path's files over
  ``copyStreams`` channels and resumes a copy dropped with its connection, ``copyRetries``
  times. The site's listing of the copied path is checked first: every entry must be a
  regular file or a folder under the copied path, resolved on disk under the destination (a
  folder there that is a link to elsewhere is refused), files are created without following
  links, and one copy's bytes and entries are capped (:mod:`xffl.workflows.extensions.caps`:
  by what the run's round-0 global holds, ``copyReference``, times ``copyFactor`` plus room
  for the JSON files, and never above ``maxCopyBytes``/``maxCopyMembers``). With a
  ``dataTransferConnection`` (a profile's ``transfer_host``) copies go through it;
* what the site answers is read whole by upstream, bounded only by a stall timeout; here
  each answer is read as it arrives with a byte cap, and each copy has an overall deadline
  (its bytes at ``copyMinRate``, never past ``copyTimeout``, the round's time limit), so a
  site that never stops talking, or trickles, fails its copy instead of the coordinator;
* the job folders StreamFlow creates at the site are ``mkdir -m 777``: another user of the
  facility could swap a job's ``update/`` before it is copied back. Here they are ``700``;
* host keys are checked against the user's ``~/.ssh/known_hosts`` only; here the site
  profile's ``known_hosts`` (``knownHosts``) is used when it has one, as for xffl's own
  connections, and channels have a 16 MiB window
  (:mod:`xffl.workflows.extensions.connection`).

What a login shell prints before each command is skipped
(:mod:`xffl.workflows.extensions.login`). ``tests/security/test_transfers.py`` shows each
upstream behaviour beside this one; the copies', ``tests/workflows/extensions/test_copies.py``
and ``tests/workflows/test_dropped_copies.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.parse
from collections.abc import AsyncIterator, MutableMapping, MutableSequence
from typing import Any

from streamflow.core.deployment import ExecutionLocation
from streamflow.deployment.connector.ssh import SSHConfig
from streamflow.log_handler import logger

from xffl.workflows.extensions.caps import (
    DEFAULT_COPY_FACTOR,
    MAX_COPY_BYTES,
    MAX_COPY_MEMBERS,
    CopyCaps,
    reference_caps,
)
from xffl.workflows.extensions.connection import KnownHostsContext, round_trip
from xffl.workflows.extensions.copies import COPY_MIN_RATE, Copier, Progress
from xffl.workflows.extensions.copy_paths import destination, download, upload
from xffl.workflows.extensions.login import LoginShellConnector

_OWNER_ONLY = "700"
DEFAULT_STREAMS = 4
DEFAULT_COPY_RETRIES = 5


class XfflSshConnector(LoginShellConnector):
    """SSHConnector with checked, parallel, resumable copies, owner-only folders and the
    profile's known_hosts."""

    def __init__(self, *args: Any, knownHosts: str | None = None,
                 maxCopyBytes: int = MAX_COPY_BYTES, maxCopyMembers: int = MAX_COPY_MEMBERS,
                 copyReference: str | None = None, copyFactor: float = DEFAULT_COPY_FACTOR,
                 copyStreams: int = DEFAULT_STREAMS, copyStreamsFromRtt: bool = True,
                 copyRetries: int = DEFAULT_COPY_RETRIES, copyTimeout: float | None = None,
                 copyMinRate: float = COPY_MIN_RATE, **kwargs: Any) -> None:
        """As SSHConnector, with ``knownHosts``, the caps of a copy from the site, the
        channels of one copy (fewer on a short round trip: ``copyStreamsFromRtt``), the
        times a dropped copy is resumed and its overall deadline (``copyTimeout``, the
        round's time limit, and ``copyMinRate``: see :meth:`Copier.limit`)."""
        self.copyTimeout = copyTimeout
        self.copyMinRate = copyMinRate
        self.knownHosts = knownHosts
        self.copyStreams = copyStreams
        self.copyStreamsFromRtt = copyStreamsFromRtt
        self.rtt: dict[str, float] = {}  # the round trip of each location's copies, seconds
        self.copyRetries = copyRetries
        self.progress: dict[str, Progress] = {}  # copies in flight, by path
        self.maxCopyBytes = maxCopyBytes
        self.maxCopyMembers = maxCopyMembers
        self.copyReference = copyReference
        self.copyFactor = copyFactor
        self._caps: CopyCaps | None = None
        super().__init__(*args, **kwargs)
        self._cls_context = KnownHostsContext

    def _get_config(self, node: str | MutableMapping[str, Any] | None) -> SSHConfig | None:
        """Upstream's settings of a node (jump hosts included), with the known_hosts file."""
        config = super()._get_config(node)
        hop = config
        while hop is not None:
            hop.known_hosts = self.knownHosts
            hop = hop.tunnel
        return config

    @classmethod
    def get_schema(cls) -> str:
        """Upstream's schema of the ssh connector, with knownHosts and the copy caps."""
        upstream: dict[str, Any] = json.loads(super().get_schema())
        base = urllib.parse.urljoin(upstream["$id"], upstream["$ref"])  # .../base/ssh.json
        return json.dumps({
            "$schema": upstream["$schema"],
            "$id": "https://xffl.dev/schemas/streamflow/xffl_ssh.json",
            "type": "object",
            "$ref": base,
            "properties": {
                "knownHosts": {"type": "string", "description": "known_hosts file for the "
                               "host keys (default: ~/.ssh/known_hosts of the user running "
                               "StreamFlow)"},
                "maxCopyBytes": {"type": "integer", "minimum": 1, "description": "the most "
                                 "bytes one copy from the site may extract"},
                "maxCopyMembers": {"type": "integer", "minimum": 1, "description": "the most "
                                   "files and folders one copy from the site may extract"},
                "copyReference": {"type": "string", "description": "a folder on this machine "
                                  "(the run's round-0 global) whose size, times copyFactor, "
                                  "caps a copy from the site"},
                "copyFactor": {"type": "number", "minimum": 1, "description": "the multiple "
                               "of copyReference one copy may hold"},
                "copyStreams": {"type": "integer", "minimum": 1, "maximum": 64,
                                "description": "SSH channels one copy uses at once (at "
                                "most)"},
                "copyStreamsFromRtt": {"type": "boolean", "description": "fewer channels "
                                       "where the round trip is short (one up to 2.1 ms)"},
                "copyRetries": {"type": "integer", "minimum": 0, "maximum": 100,
                                "description": "times one copy is resumed after a dropped "
                                "connection before it fails"},
                "copyTimeout": {"type": "number", "exclusiveMinimum": 0, "description":
                                "seconds one copy may take at most (the round's time "
                                "limit)"},
                "copyMinRate": {"type": "number", "exclusiveMinimum": 0, "description":
                                "bytes/s: a copy fails once it takes longer than its bytes "
                                "at this rate (plus a stall window per attempt)"},
            },
            "unevaluatedProperties": False,
        })

    def copy_caps(self) -> CopyCaps:
        """This site's caps of one copy (from ``copyReference`` once it exists, then kept)."""
        if self._caps is not None:
            return self._caps
        ceiling = CopyCaps(self.maxCopyBytes, self.maxCopyMembers)
        caps = reference_caps(self.copyReference, self.copyFactor, ceiling)
        if self.copyReference is None or os.path.isdir(self.copyReference):
            self._caps = caps
        return caps

    def _copier(self, location: ExecutionLocation) -> Copier:
        """A copier whose channels are this location's (its data transfer connection's)."""
        factory = self._get_ssh_context_factory(location)

        @contextlib.asynccontextmanager
        async def open_process(command: str, upload: bool) -> AsyncIterator[Any]:
            pipe, null = asyncio.subprocess.PIPE, asyncio.subprocess.DEVNULL
            context = factory.get(command=command, environment=location.environment,
                                  stdin=pipe if upload else null,
                                  stdout=null if upload else pipe, stderr=null, encoding=None)
            proc = await context.__aenter__()
            try:
                yield proc
            finally:  # the channel's close, bounded: a site need not answer it
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(context.__aexit__(None, None, None),
                                           float(self.connectTimeout))

        async def recover() -> None:
            # upstream reconnects only once a new channel fails to open on the dead
            # connection, and counts that as a connection attempt: forget it here instead
            for context in factory._contexts:
                conn = context._ssh_connection
                if conn is not None and conn.is_closed():
                    await context.close()
                    context._connect_event.clear()

        async def measure() -> float:
            # once per location: the link's round trip does not change copy by copy
            if location.name not in self.rtt:
                conn = await factory._contexts[0].get_connection()
                self.rtt[location.name] = await round_trip(conn)
            return self.rtt[location.name]

        return Copier(open_process, recover, self.copyStreams, self.copyRetries,
                      float(self.retryDelay), self.transferBufferSize,
                      stall_s=float(self.connectTimeout),
                      round_trip=measure if self.copyStreamsFromRtt else None,
                      timeout_s=self.copyTimeout, min_rate=self.copyMinRate)

    async def copy_remote_to_local(self, src: str, dst: str, location: ExecutionLocation,
                                   read_only: bool = False) -> None:
        """The site's ``src`` to ``dst`` here: checked listing, parallel resumable pieces."""
        logger.info(f"COPYING from {src!r} on location {location} to {dst!r} on local "
                    "file-system")
        copier = self._copier(location)
        caps = self.copy_caps()
        self.progress[src] = copier.progress
        try:
            await download(copier, src, dst, caps.bytes, caps.members)
        finally:
            self.progress.pop(src, None)
        logger.info(f"COMPLETED copy from {src!r} on location {location} to {dst!r} on local "
                    f"file-system ({copier.describe()})")

    async def copy_local_to_remote(self, src: str, dst: str,
                                   locations: MutableSequence[ExecutionLocation],
                                   read_only: bool = False) -> None:
        """``src`` here to ``dst`` at each location: parallel resumable pieces, owner-only."""
        dst = await destination(self._copier(locations[0]), src, dst)

        async def one(location: ExecutionLocation) -> None:
            logger.info(f"COPYING from {src!r} on local file-system to {dst!r} on location "
                        f"{location}")
            copier = self._copier(location)
            self.progress[src] = copier.progress
            try:
                await upload(copier, src, dst)
            finally:
                self.progress.pop(src, None)
            logger.info(f"COMPLETED copy from {src!r} on local file-system to {dst!r} on location "
                        f"{location} ({copier.describe()})")

        await asyncio.gather(*(one(location) for location in locations))

    async def run(self, location: ExecutionLocation, command: MutableSequence[str],
                  environment: MutableMapping[str, str] | None = None,
                  workdir: str | None = None, stdin: int | str | None = None,
                  stdout: int | str = asyncio.subprocess.STDOUT,
                  stderr: int | str = asyncio.subprocess.STDOUT,
                  capture_output: bool = False, timeout: int | None = None,
                  job_name: str | None = None) -> tuple[str, int] | None:
        """Run ``command`` at the site; StreamFlow's ``mkdir -m 777`` becomes owner-only."""
        if list(command[:3]) == ["mkdir", "-m", "777"]:
            command = ["mkdir", "-m", _OWNER_ONLY, *command[3:]]
        result: tuple[str, int] | None = await super().run(
            location, command, environment, workdir, stdin, stdout, stderr, capture_output,
            timeout, job_name)
        return result
