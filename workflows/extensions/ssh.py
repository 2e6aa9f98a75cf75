"""StreamFlow's SSH connector for an untrusted facility: ``xffl-ssh``.

What StreamFlow 0.2.0rc3's ``SSHConnector`` does that an untrusted facility could abuse, and
what this subclass (registered by xffl's StreamFlow plugin) does instead:

* a copy from the site is a tar stream that ``streamflow.deployment.connector.base.
  extract_tar_stream`` extracts with no member filter: names with ``..`` or absolute names
  land outside the destination, links and devices are created as they come. Here a copy is
  not a tar stream (see below): the site's listing of the copied path is checked first, and
  every entry must be a regular file or a folder under the copied path, resolved on disk
  under the destination (a folder there that is a link to elsewhere is refused), files are
  created without following links, and one copy's bytes and entries are capped: by what the
  run's round-0 global holds (``copyReference``) times ``copyFactor`` plus room for the JSON
  files, and never above ``maxCopyBytes``/``maxCopyMembers``. :func:`safe_extract` applies
  the same rules to a tar stream (xffl's own copies no longer send one);
* the job folders StreamFlow creates at the site are ``mkdir -m 777``: another user of the
  facility could swap a job's ``update/`` before it is copied back. Here they are ``700``;
* host keys are checked against the user's ``~/.ssh/known_hosts`` only; here the site
  profile's ``known_hosts`` (``knownHosts``) is used when it has one, as for xffl's own
  connections.

And one thing it does that breaks on an ordinary login node: what the account's login shell
prints before the command (a ``.bashrc`` that loads modules, two ``pyenv rehash`` racing:
``rm: cannot remove '.../shims/tmp.X'``) is read as the command's output. The hardware probe
(``_get_available_location``, stderr merged into stdout) then fails the deployment with
"Impossible to retrieve available hardware", and the persistent shell hands that text to its
first command (``sbatch --parsable``'s job id included). Here the probe reads only what follows
a marker, with the probe's own stderr discarded; a new shell's own stderr is discarded and
its stdout read up to a first marker before it is used.

Copies do not take upstream's one ``tar`` stream: :mod:`xffl.workflows.extensions.copies`
moves a path's files over ``copyStreams`` channels (each with a 16 MiB window) and resumes
a copy dropped with its connection, ``copyRetries`` times; a listing of what a site sends is
checked before anything is written (regular files and folders under the copied path, within
the caps above). With a ``dataTransferConnection`` (a profile's ``transfer_host``) copies go
through it, while the persistent shell, which upstream also opens there, stays on the login
node.

``tests/security/test_transfers.py`` shows each upstream behaviour beside this one; the login
shell's, ``tests/workflows/extensions/test_ssh.py``; the copies',
``tests/workflows/extensions/test_copies.py`` and ``tests/workflows/test_dropped_copies.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import posixpath
import urllib.parse
from collections.abc import AsyncIterator, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import asyncssh
from streamflow.core.deployment import ExecutionLocation, Shell
from streamflow.core.exception import WorkflowExecutionException
from streamflow.core.scheduling import Hardware, Storage
from streamflow.core.utils import get_local_to_remote_destination
from streamflow.deployment import aiotarstream
from streamflow.deployment.connector.base import FS_TYPES_TO_SKIP
from streamflow.deployment.connector.ssh import (
    SSHConfig,
    SSHConnector,
    SSHContext,
    SSHShell,
    get_param_from_file,
    parse_hostname,
)
from streamflow.log_handler import logger

from xffl.workflows.extensions.copies import Copier, Progress
from xffl.workflows.extensions.copy_paths import download, upload

MAX_COPY_BYTES = 4 << 40  # 4 TiB: far above a checkpoint, far below a full disk's worth
MAX_COPY_MEMBERS = 100_000  # files and folders of one copy; a checkpoint has a few hundred
# beyond copyFactor x the reference: an update's JSON files (manifest, config, index,
# slurm_job.json, ...; the coordinator reads each only below 16 MiB) and their folders
COPY_SLACK_BYTES = 64 << 20
COPY_SLACK_MEMBERS = 64
DEFAULT_COPY_FACTOR = 4.0  # an update in fp32 of a 16-bit global is 2x; twice that again
_OWNER_ONLY = "700"
# upstream's hardware probe (cores, memory in KiB, then "mount type KiB" per file system)
_PROBE = ("nproc && free | grep Mem | awk '{print $2}' && df -aT | tail -n +2 | "
          "awk 'NF == 1 {device = $1; getline; $0 = device $0} {print $7, $2, $5}'")
_MARK = "XFFL_OUTPUT_FOLLOWS"
SHELL_START_TIMEOUT_S = 60  # for a login shell to get through its start-up files
COPY_WINDOW = 16 << 20  # a channel's receive window: 320 MB/s per stream at 50 ms
COPY_PACKET = 256 << 10  # the largest packet a site may send (fewer, larger packets)
DEFAULT_STREAMS = 4
DEFAULT_COPY_RETRIES = 5


class UnsafeArchive(WorkflowExecutionException):
    """A tar stream from a site held something a checkpoint copy never holds."""


@dataclass(frozen=True)
class CopyCaps:
    """The most bytes and members (files and folders) one copy from a site may extract."""

    bytes: int = MAX_COPY_BYTES
    members: int = MAX_COPY_MEMBERS


def reference_caps(reference: str | None, factor: float, ceiling: CopyCaps) -> CopyCaps:
    """The caps of a copy that holds at most ``factor`` times the files under ``reference``.

    ``reference`` is the run's round-0 global: its kind (a whole model, a LoRA adapter) is
    what every update of the run has. Without one, or before it exists, ``ceiling``.
    """
    if reference is None or not os.path.isdir(reference):
        return ceiling
    size = count = 0
    for folder, dirs, files in os.walk(reference):
        count += len(dirs) + len(files)
        size += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
    return CopyCaps(bytes=min(ceiling.bytes, math.ceil(factor * size) + COPY_SLACK_BYTES),
                    members=min(ceiling.members,
                                math.ceil(factor * (count + 1)) + COPY_SLACK_MEMBERS))


def _inside(path: str, real_dst: str) -> bool:
    """Whether ``path``, its links resolved on disk, is ``real_dst`` or under it."""
    return os.path.commonpath([os.path.realpath(path), real_dst]) == real_dst


async def safe_extract(tar: aiotarstream.AioTarStream, src: str, dst: str,
                       buffer_size: int, caps: CopyCaps = CopyCaps()) -> None:
    """Extract the copy of ``src`` into ``dst``: regular files and folders under it only.

    A member named ``<basename(src)>[/rest]`` becomes ``dst[/rest]``; anything else (an
    absolute name, ``..``, a name outside the copied folder, a link, a device or FIFO, a
    path that a link already on disk would lead out of ``dst``, more than ``caps`` in
    all) raises UnsafeArchive before it is written.
    """
    root = posixpath.basename(src.rstrip("/"))
    real_dst = os.path.realpath(dst)
    total = members = 0
    async for member in tar:
        name = member.name
        members += 1
        if members > caps.members:
            raise UnsafeArchive(f"refused to extract {name!r}: the copy of {src} holds more "
                                f"than {caps.members} files and folders")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or ".." in parts or not parts or parts[0] != root:
            raise UnsafeArchive(f"refused to extract {name!r}: not a path under {root}")
        if not (member.isreg() or member.isdir()):
            raise UnsafeArchive(f"refused to extract {name!r}: not a regular file or folder")
        target = os.path.join(real_dst, *parts[1:])
        # the name stays under dst (above); on disk, a folder on its way may be a link
        # (left by anyone who can write there): resolved, it must stay under dst too
        # (a copied file is dst itself: its folder is StreamFlow's choice, not the site's)
        folder = target if member.isdir() or target == real_dst else os.path.dirname(target)
        if not _inside(folder, real_dst):
            raise UnsafeArchive(f"refused to extract {name!r}: a link on its way leads "
                                f"outside {dst}")
        if member.isdir():
            os.makedirs(target, mode=0o700, exist_ok=True)
            continue
        total += member.size
        if total > caps.bytes:
            raise UnsafeArchive(f"refused to extract {name!r}: the copy of {src} exceeds "
                                f"{caps.bytes} bytes")
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        # O_NOFOLLOW: a link put there by an earlier member (never, see above) or anyone else
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            reader = await tar.extractfile(member)
            if reader is None:
                raise UnsafeArchive(f"refused to extract {name!r}: unreadable member")
            async with reader as source:
                while chunk := await source.read(buffer_size):
                    out.write(chunk)


class _KnownHostsContext(SSHContext):
    """An SSH connection whose host key is checked against the node's own known_hosts file,
    and whose channels take ``COPY_WINDOW`` bytes in flight (asyncssh's default, 2 MiB, holds
    one stream to 40 MB/s at 50 ms round trip)."""

    async def _get_connection(self, config: SSHConfig | None) -> Any:
        if config is None:
            return None
        known = getattr(config, "known_hosts", None)
        if not config.check_host_key:
            known_hosts: Any = None
        else:  # upstream's () is asyncssh's default (~/.ssh/known_hosts)
            known_hosts = known if known is not None else ()
        # upstream's call, with the known_hosts file and the channel window
        hostname, port = parse_hostname(config.hostname)
        return await asyncssh.connect(
            client_keys=config.client_keys, compression_algs=None,
            encryption_algs=["aes128-gcm@openssh.com", "aes256-ctr", "aes192-ctr",
                             "aes128-ctr"],
            known_hosts=known_hosts, host=hostname,
            passphrase=get_param_from_file(config.ssh_key_passphrase_file,
                                           self._streamflow_config_dir),
            password=get_param_from_file(config.password_file, self._streamflow_config_dir),
            port=port, tunnel=await self._get_connection(config.tunnel),
            username=config.username, connect_timeout=config.connect_timeout,
            window=COPY_WINDOW, max_pktsize=COPY_PACKET)


class XfflSshConnector(SSHConnector):
    """SSHConnector with safe extraction, owner-only folders and the profile's known_hosts."""

    def __init__(self, *args: Any, knownHosts: str | None = None,
                 maxCopyBytes: int = MAX_COPY_BYTES, maxCopyMembers: int = MAX_COPY_MEMBERS,
                 copyReference: str | None = None, copyFactor: float = DEFAULT_COPY_FACTOR,
                 copyStreams: int = DEFAULT_STREAMS, copyRetries: int = DEFAULT_COPY_RETRIES,
                 **kwargs: Any) -> None:
        """As SSHConnector, with ``knownHosts``, the caps of a copy from the site, the
        channels of one copy and the times a dropped copy is resumed."""
        self.knownHosts = knownHosts
        self.copyStreams = copyStreams
        self.copyRetries = copyRetries
        self.progress: dict[str, Progress] = {}  # copies in flight, by path
        self.maxCopyBytes = maxCopyBytes
        self.maxCopyMembers = maxCopyMembers
        self.copyReference = copyReference
        self.copyFactor = copyFactor
        self._caps: CopyCaps | None = None
        super().__init__(*args, **kwargs)
        self._cls_context = _KnownHostsContext

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
                                "description": "SSH channels one copy uses at once"},
                "copyRetries": {"type": "integer", "minimum": 0, "maximum": 100,
                                "description": "times one copy is resumed after a dropped "
                                "connection before it fails"},
            },
            "unevaluatedProperties": False,
        })

    async def _get_available_location(self, location: str) -> Hardware:
        """Upstream's hardware probe, read from a marker on: login-shell noise is not hardware."""
        if location not in self.hardware:
            async with self._get_ssh_client_process(
                    location=location, command=f"echo {_MARK} && {_PROBE}",
                    stderr=asyncio.subprocess.DEVNULL) as proc:
                result = await proc.wait()
            out = str(result.stdout)
            if result.returncode != 0 or _MARK not in out:
                raise WorkflowExecutionException(
                    f"Impossible to retrieve available hardware for location "
                    f"{self.deployment_name}: the probe exited {result.returncode}")
            cores, memory, *mounts = out.split(_MARK, 1)[1].strip().split("\n")
            try:
                hardware = Hardware(float(cores), float(memory))
            except ValueError:
                raise WorkflowExecutionException(
                    f"Impossible to retrieve available hardware for location "
                    f"{self.deployment_name}: {cores!r} is not a number of cores") from None
            for line in mounts:
                mount_point, fs_type, size = ([*line.split(" "), "", ""])[:3]
                if (mount_point == posixpath.sep or fs_type not in FS_TYPES_TO_SKIP) \
                        and size.isdigit():
                    hardware.storage[mount_point] = Storage(mount_point=mount_point,
                                                            size=float(size) / 2**10)
            self.hardware[location] = hardware
        return self.hardware[location]

    async def _create_shell(self, command: MutableSequence[str],
                            location: ExecutionLocation) -> Shell:
        """Upstream's persistent shell on the login node, less what the login shell prints
        before it (upstream opens it on the data transfer node when there is one).

        The shell's own stderr is dropped: only the login's start-up files write there (every
        command the shell runs has ``2>&1``), and sshd may forward it after a command's
        output. What they print on stdout comes first, in order, and is read away here.
        """
        # the login node's connection (upstream would take the data transfer node's)
        context = self._get_ssh_client_process(
            location=location.name, command=" ".join(command),
            environment=location.environment, stderr=asyncio.subprocess.DEVNULL,
            encoding=None)
        shell: Shell = SSHShell(command=command, buffer_size=self.transferBufferSize,
                                process=await context.__aenter__(), context=context)
        try:
            await shell.execute(["echo", _MARK], capture_output=True,
                                timeout=SHELL_START_TIMEOUT_S)
        except BaseException:
            await shell.close()
            raise
        return shell

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
            finally:
                with contextlib.suppress(Exception):
                    await context.__aexit__(None, None, None)

        async def recover() -> None:
            # upstream reconnects only once a new channel fails to open on the dead
            # connection, and counts that as a connection attempt: forget it here instead
            for context in factory._contexts:
                conn = context._ssh_connection
                if conn is not None and conn.is_closed():
                    await context.close()
                    context._connect_event.clear()

        return Copier(open_process, recover, self.copyStreams, self.copyRetries,
                      float(self.retryDelay), self.transferBufferSize,
                      stall_s=float(self.connectTimeout))

    async def copy_remote_to_local(self, src: str, dst: str, location: ExecutionLocation,
                                   read_only: bool = False) -> None:
        """The site's ``src`` to ``dst`` here: checked listing, parallel resumable pieces."""
        logger.info(f"COPYING from {src} on location {location} to {dst} on local file-system")
        copier = self._copier(location)
        caps = self.copy_caps()
        self.progress[src] = copier.progress
        try:
            await download(copier, src, dst, caps.bytes, caps.members)
        finally:
            self.progress.pop(src, None)
        logger.info(f"COMPLETED copy from {src} on location {location} to {dst} on local "
                    f"file-system ({copier.progress.attempts} attempt(s))")

    async def copy_local_to_remote(self, src: str, dst: str,
                                   locations: MutableSequence[ExecutionLocation],
                                   read_only: bool = False) -> None:
        """``src`` here to ``dst`` at each location: parallel resumable pieces, owner-only."""
        dst = await get_local_to_remote_destination(self, locations[0], src, dst)

        async def one(location: ExecutionLocation) -> None:
            logger.info(f"COPYING from {src} on local file-system to {dst} on location "
                        f"{location}")
            copier = self._copier(location)
            self.progress[src] = copier.progress
            try:
                await upload(copier, src, dst)
            finally:
                self.progress.pop(src, None)
            logger.info(f"COMPLETED copy from {src} on local file-system to {dst} on location "
                        f"{location} ({copier.progress.attempts} attempt(s))")

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
