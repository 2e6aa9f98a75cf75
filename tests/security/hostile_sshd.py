"""A facility's sshd whose every answer is the attacker's: asyncssh on 127.0.0.1.

``python -m tests.security.hostile_sshd PORT_FILE SENT_FILE`` listens on a free port of
127.0.0.1 (written to PORT_FILE once it listens), takes any login without authentication,
and answers xffl-ssh's commands as a compromised account can; the user name picks the attack:

* ``listing``: ``find`` prints a 256 MiB listing of short names, as fast as the channel takes;
* ``probe``: the hardware probe prints its marker, then numbers for ever, as fast as it can;
* ``probe-slow``: the probe prints its marker, then a line a second, for ever;
* ``shell``: every command (the persistent shell included) prints for ever;
* ``honest``: the probe answers as a real login node whose shell prints a line first;
* ``sha``: ``sha256sum`` answers with 1 GB of hex digits;
* ``folder``: the folder test (``if test -d``) prints for ever;
* ``trickle``: ``find`` lists one 1000-byte file honestly; ``head``/``tail`` send one byte
  every 0.5 s, for ever (inside any stall window of a second or more).

Anything else exits 0 at once. Each answer appends ``WORD BYTES`` to SENT_FILE when it ends
(the bytes it got into the channel before the client closed it).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncssh

LISTING_BYTES = 256 << 20
SHA_BYTES = 1 << 30
CHUNK = 1 << 16


class _Server(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return False  # no authentication: the attack is in the answers


async def _send(process: asyncssh.SSHServerProcess[bytes], chunks: Iterator[bytes],
                pause: float) -> int:
    sent = 0
    try:
        for chunk in chunks:
            process.stdout.write(chunk)
            await process.stdout.drain()
            sent += len(chunk)
            if pause:
                await asyncio.sleep(pause)
    except (asyncssh.Error, OSError, BrokenPipeError, ConnectionError):
        pass
    return sent


def _repeat(block: bytes, total: int | None) -> Iterator[bytes]:
    n = 0
    while total is None or n < total:
        yield block
        n += len(block)


def _listing() -> Iterator[bytes]:
    yield b"d 0 \0"
    i = 0
    while True:
        block = b"".join(b"f 1 n%09d\0" % (i + k) for k in range(4096))
        i += 4096
        yield block


def _answer(user: str, command: str) -> tuple[str, Iterator[bytes], float] | None:
    if user == "listing" and command.startswith("find "):
        chunks = _listing()

        def capped() -> Iterator[bytes]:
            n = 0
            for c in chunks:
                if n >= LISTING_BYTES:
                    return
                n += len(c)
                yield c
        return "find", capped(), 0.0
    if user.startswith("probe") and "XFFL_OUTPUT_FOLLOWS" in command:
        slow = user == "probe-slow"

        def printer() -> Iterator[bytes]:
            yield b"XFFL_OUTPUT_FOLLOWS\n"
            yield from _repeat(b"4\n" if slow else b"4\n" * (CHUNK // 2), None)
        return "probe", printer(), 1.0 if slow else 0.0
    if user == "honest" and "XFFL_OUTPUT_FOLLOWS" in command:  # the login shell talks first
        return "probe", iter([b"Lmod: 3 modules loaded\nXFFL_OUTPUT_FOLLOWS\n4\n1000\n",
                              b"/ ext4 2048\n"]), 0.0
    if user == "shell":  # the persistent shell, and everything else: for ever
        return "shell", _repeat(b"y" * 1023 + b"\n", None), 0.0
    if user == "sha" and "sha256sum" in command:
        return "sha256sum", _repeat(b"a" * CHUNK, SHA_BYTES), 0.0
    if user == "folder" and command.startswith("if test -d"):
        return "folder", _repeat(b"folder\n" * 1000, None), 0.0
    if user == "trickle" and command.startswith("find "):
        return "find", iter([b"d 0 \0f 1000 model.safetensors\0"]), 0.0
    if user == "trickle" and command.startswith(("head ", "tail ")):
        return "head", _repeat(b"x", None), 0.5
    return None


def serve(port_file: Path, sent_file: Path) -> None:
    """Listen until killed (see the module doc)."""

    async def handle(process: asyncssh.SSHServerProcess[bytes]) -> None:
        user = process.get_extra_info("username")
        answer = _answer(user, process.command or "")
        sent = 0
        if answer is not None:
            word, chunks, pause = answer
            sent = await _send(process, chunks, pause)
            with sent_file.open("a") as out:
                out.write(f"{word} {sent}\n")
        process.exit(0)

    async def main() -> None:
        key = asyncssh.generate_private_key("ssh-ed25519")
        server = await asyncssh.create_server(
            _Server, "127.0.0.1", 0, server_host_keys=[key], process_factory=handle,
            encoding=None, line_editor=False)
        port = server.sockets[0].getsockname()[1]
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(port_file)
        await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
