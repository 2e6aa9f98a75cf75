"""A TCP proxy on 127.0.0.1 that delays every byte by half a round trip each way (and may
cap the rate): an emulated wide-area link in front of a local sshd (no ``tc netem`` here)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

HOST = "127.0.0.1"
CHUNK = 256 << 10
RATE_SLICE = 16 << 10  # a capped link sends this much at a time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                rate: float | None) -> None:
    """Forward ``reader`` to ``writer``, each chunk ``delay`` s after it arrived, at most
    ``rate`` bytes/s."""
    # a capped link holds little in flight (what is not yet sent stays with the sender, as
    # behind a slow link); a delaying one holds whatever arrives within the delay
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(4 if rate else 0)

    async def read() -> None:
        try:
            while data := await reader.read(RATE_SLICE if rate else CHUNK):
                await queue.put((time.monotonic() + delay, data))
        finally:  # EOF or a reset: the other side is closed after what came before
            with contextlib.suppress(asyncio.CancelledError):
                await queue.put((0.0, b""))

    task = asyncio.ensure_future(read())
    free = time.monotonic()  # when the capped link is free to send again
    try:
        while True:
            due, data = await queue.get()
            if not data:
                break
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            for at in range(0, len(data), RATE_SLICE if rate else len(data)):
                piece = data[at:at + RATE_SLICE] if rate else data
                if rate is not None:  # no burst after a quiet spell: pace from now
                    free = max(free, time.monotonic())
                    if (wait := free - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                    free += len(piece) / rate
                writer.write(piece)
                await writer.drain()
    finally:
        task.cancel()
        with contextlib.suppress(Exception):
            writer.close()


async def serve(target_port: int, rtt_s: float, rate: float | None = None,
                port: int = 0) -> asyncio.Server:
    """Listen on 127.0.0.1:``port`` (0: any free one) and forward to ``target_port``."""

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if rate is not None:  # a small kernel buffer: the bytes wait at the sender
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RATE_SLICE * 2)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (HOST, target_port))
            server_r, server_w = await asyncio.open_connection(sock=sock)
        except OSError:
            client_w.close()
            return
        pipes = [asyncio.ensure_future(_pipe(client_r, server_w, rtt_s / 2, rate)),
                 asyncio.ensure_future(_pipe(server_r, client_w, rtt_s / 2, rate))]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for writer in (client_w, server_w):  # one side gone: the link is gone
            writer.close()
        await asyncio.gather(*pipes, return_exceptions=True)

    return await asyncio.start_server(handle, HOST, port)


@contextlib.contextmanager
def running(target_port: int, rtt_s: float, rate: float | None = None) -> Iterator[int]:
    """A proxy in a thread of its own (its own event loop); yields its port."""
    loop = asyncio.new_event_loop()
    ready: list[asyncio.Server] = []
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        ready.append(loop.run_until_complete(serve(target_port, rtt_s, rate)))
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the delaying proxy did not start")
    try:
        yield ready[0].sockets[0].getsockname()[1]
    finally:
        loop.call_soon_threadsafe(ready[0].close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def main() -> None:
    """``proxy.py TARGET_PORT RTT_MS [RATE_BYTES_PER_S]``: print the port, serve until killed."""
    import sys

    target, rtt_ms = int(sys.argv[1]), float(sys.argv[2])
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else None

    async def run() -> None:
        server = await serve(target, rtt_ms / 1000, rate)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    asyncio.run(run())


if __name__ == "__main__":
    main()
