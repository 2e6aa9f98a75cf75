"""StreamFlow's SSH connector on a login node whose shell prints before each command.

StreamFlow 0.2.0rc3's ``SSHConnector`` reads what the account's login shell prints before
the command (a ``.bashrc`` that loads modules, two ``pyenv rehash`` racing: ``rm: cannot
remove '.../shims/tmp.X'``) as the command's output. The hardware probe
(``_get_available_location``, stderr merged into stdout) then fails the deployment with
"Impossible to retrieve available hardware", and the persistent shell hands that text to its
first command (``sbatch --parsable``'s job id included). Here the probe reads only what
follows a marker, with the probe's own stderr discarded; a new shell's own stderr is
discarded and its stdout read up to a first marker before it is used. The probe's answer
is read as it comes, at most ``PROBE_BYTES`` within ``PROBE_TIMEOUT_S`` (upstream reads it
whole, with no time limit: a login shell that prints for ever held the deployment and grew
the coordinator's memory without end). The persistent shell keeps at most the last
``SHELL_OUTPUT_BYTES`` of a command's output (:class:`BoundedShell`), as does a command run
without it (upstream's ``run`` reads its whole output through ``wait``), and the shell's
start is bounded by ``SHELL_START_TIMEOUT_S`` as a whole. The persistent shell stays on the
login node even with a ``dataTransferConnection`` (upstream opens it there).
``tests/workflows/extensions/test_login.py`` shows upstream's behaviour beside this one.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from collections.abc import MutableSequence
from typing import Any

from streamflow.core.deployment import ExecutionLocation, Shell
from streamflow.core.exception import WorkflowExecutionException
from streamflow.core.scheduling import Hardware, Storage
from streamflow.deployment.connector.base import FS_TYPES_TO_SKIP
from streamflow.deployment.connector.ssh import SSHConnector, SSHShell

# upstream's hardware probe (cores, memory in KiB, then "mount type KiB" per file system)
_PROBE = ("nproc && free | grep Mem | awk '{print $2}' && df -aT | tail -n +2 | "
          "awk 'NF == 1 {device = $1; getline; $0 = device $0} {print $7, $2, $5}'")
_MARK = "XFFL_OUTPUT_FOLLOWS"
SHELL_START_TIMEOUT_S = 60  # for a login shell to get through its start-up files
# the probe prints two numbers and a line per mount (about 60 bytes): 1 MiB is a node with
# over 10,000 mounts after its login shell's chatter; it runs for a shell's start at most
PROBE_BYTES = 1 << 20
PROBE_TIMEOUT_S = SHELL_START_TIMEOUT_S
# a command's output through the persistent shell is kept up to this many bytes, its last
# ones (a job's log read with `cat` included); what came before is left out, never an error
SHELL_OUTPUT_BYTES = 16 << 20


class BoundedShell(SSHShell):
    """StreamFlow's persistent SSH shell, holding at most the last SHELL_OUTPUT_BYTES of a
    command's output (upstream keeps all of it, and searches all of it for the end marker
    after every read: a site that prints without end grew the coordinator without end)."""

    async def _read_with_output(self, end_marker: str, timeout: int | None) -> tuple[str, int]:
        """The command's output (its last SHELL_OUTPUT_BYTES) and exit status."""
        return await self._read_to(end_marker, timeout)

    async def _read_without_output(self, end_marker: str, timeout: int | None) -> None:
        """Read the command's output away, up to its end marker."""
        await self._read_to(end_marker, timeout)

    deadline: float | None = None  # time.monotonic() by which the command must have ended

    async def _read_to(self, end_marker: str, timeout: int | None) -> tuple[str, int]:
        mark = f"{end_marker}:".encode()
        kept, dropped, found = bytearray(), 0, -1
        while True:
            try:
                chunk = await asyncio.wait_for(self._reader.read(self.buffer_size), timeout)
            except TimeoutError:
                raise WorkflowExecutionException("Timeout waiting for command output") from None
            if not chunk:
                raise WorkflowExecutionException("Shell process terminated unexpectedly")
            # checked here: a cancellation can be lost in a wait_for whose read is done
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise WorkflowExecutionException("Timeout waiting for command output")
            scan = max(0, len(kept) - len(mark))
            kept.extend(chunk)
            if found < 0:
                found = kept.find(mark, scan)
            if found >= 0 and (end := kept.find(b"\n", found)) >= 0:
                code = kept[found + len(mark):end]
                if not code.strip().lstrip(b"-").isdigit():
                    raise WorkflowExecutionException(f"Invalid return code: {bytes(code)!r}")
                out = kept[:found].decode("utf-8", "replace").strip()
                if dropped:
                    out = f"[{dropped} bytes of output left out]\n{out}"
                return out, int(code)
            if found >= 0 and len(kept) - found > len(mark) + 32:  # no status ends it
                raise WorkflowExecutionException("Invalid return code: no end of line")
            if found < 0 and len(kept) > SHELL_OUTPUT_BYTES:  # keep the tail
                cut = len(kept) - SHELL_OUTPUT_BYTES
                del kept[:cut]
                dropped += cut


class _TailProcess:
    """An asyncssh client process whose ``wait`` keeps the last SHELL_OUTPUT_BYTES of its
    stdout (upstream's ``run`` reads a command's whole output through ``wait``)."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)

    async def wait(self, check: bool = False, timeout: float | None = None) -> Any:
        """The completed process, its stdout the last SHELL_OUTPUT_BYTES of what came."""
        kept: Any = None

        async def read() -> Any:
            nonlocal kept
            while chunk := await self._proc.stdout.read(1 << 16):
                kept = chunk if kept is None else (kept + chunk)[-SHELL_OUTPUT_BYTES:]
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError  # a read of buffered bytes never lets a timeout in
            return await self._proc.wait(check=check)

        deadline = None if timeout is None else time.monotonic() + timeout
        result = await asyncio.wait_for(read(), timeout)
        if kept is not None:
            result.stdout = kept
        return result


class _TailContext:
    """An SSH process's context manager whose process is a :class:`_TailProcess`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __aenter__(self) -> _TailProcess:
        return _TailProcess(await self._inner.__aenter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._inner.__aexit__(*exc)


class LoginShellConnector(SSHConnector):
    """SSHConnector whose hardware probe and persistent shell skip the login shell's noise."""

    def _get_ssh_client_process(self, *args: Any, **kwargs: Any) -> Any:
        """Upstream's SSH process, whose ``wait`` keeps only the tail of its output."""
        return _TailContext(super()._get_ssh_client_process(*args, **kwargs))

    async def _get_available_location(self, location: str) -> Hardware:
        """Upstream's hardware probe, read from a marker on: login-shell noise is not hardware."""
        if location not in self.hardware:
            out, code = await self._probe(location)
            if code != 0 or _MARK not in out:
                raise WorkflowExecutionException(
                    f"Impossible to retrieve available hardware for location "
                    f"{self.deployment_name}: the probe exited {code}")
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

    async def _probe(self, location: str) -> tuple[str, int | None]:
        """What the hardware probe printed and its exit status: at most PROBE_BYTES, within
        PROBE_TIMEOUT_S (the login shell prints first; a site that prints for ever fails)."""
        out = bytearray()
        async with self._get_ssh_client_process(
                location=location, command=f"echo {_MARK} && {_PROBE}",
                stderr=asyncio.subprocess.DEVNULL, encoding=None) as proc:

            async def read() -> int | None:
                while chunk := await proc.stdout.read(1 << 16):
                    out.extend(chunk)
                    if len(out) > PROBE_BYTES:
                        raise WorkflowExecutionException(
                            f"Impossible to retrieve available hardware for location "
                            f"{self.deployment_name}: the probe printed more than "
                            f"{PROBE_BYTES} bytes")
                status: int | None = (await proc.wait()).returncode
                return status

            try:
                code = await asyncio.wait_for(read(), PROBE_TIMEOUT_S)
            except TimeoutError:
                raise WorkflowExecutionException(
                    f"Impossible to retrieve available hardware for location "
                    f"{self.deployment_name}: the probe did not end within "
                    f"{PROBE_TIMEOUT_S} s") from None
        return out.decode("utf-8", "replace"), code

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
        shell = BoundedShell(command=command, buffer_size=self.transferBufferSize,
                                    process=await context.__aenter__(), context=context)
        shell.deadline = time.monotonic() + SHELL_START_TIMEOUT_S
        try:
            await asyncio.wait_for(shell.execute(["echo", _MARK], capture_output=True,
                                                 timeout=SHELL_START_TIMEOUT_S),
                                   SHELL_START_TIMEOUT_S)
        except BaseException:
            await shell.close()
            raise
        shell.deadline = None
        return shell
