"""The round trip xffl-ssh measures before a copy, on the stack's real sshd: directly on
loopback and through bench/transfer/proxy.py, which delays each direction by half the RTT."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from asyncssh.constants import MSG_GLOBAL_REQUEST, MSG_IGNORE, MSG_REQUEST_FAILURE
from streamflow.core.deployment import ExecutionLocation

from xffl.workflows.extensions.connection import RTT_PROBES, round_trip
from xffl.workflows.extensions.copies import Copier, streams_for_rtt
from xffl.workflows.extensions.ssh import XfflSshConnector

PROXY = Path(__file__).resolve().parents[3] / "bench" / "transfer" / "proxy.py"
# the proxy's: 100 ms each way, slept, so no round trip through it is shorter
RTT_MS = 200


@pytest.fixture
def proxied(slurm_stack: Any, tmp_path: Path) -> Iterator[tuple[int, str]]:  # type: ignore[no-untyped-def]
    """(port, known_hosts) of a RTT_MS round-trip proxy in front of alpha's sshd."""
    proc = subprocess.Popen([sys.executable, str(PROXY),
                             str(slurm_stack.clusters["alpha"].ssh_port), str(RTT_MS)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        key = Path(slurm_stack.host_key_pub).read_text().split()[:2]
        known = tmp_path / "known_hosts"
        known.write_text(f"[127.0.0.1]:{port} {' '.join(key)}\n")
        yield port, str(known)
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def _measure(stack: Any, port: int, known_hosts: str) -> tuple[float, int, list[int]]:
    """(the round trip measured, sshd's answer to a keepalive, the types of the packets the
    client sent while it measured)."""
    async with asyncssh.connect("127.0.0.1", port, username=stack.user,
                                client_keys=[stack.ssh_key], known_hosts=known_hosts) as conn:
        sent: list[int] = []
        send = conn.send_packet

        def noted(pkttype: int, *args: bytes, **kwargs: Any) -> None:
            if pkttype != MSG_IGNORE:  # asyncssh puts one before each packet (CBC padding)
                sent.append(pkttype)
            send(pkttype, *args, **kwargs)

        conn.send_packet = noted  # type: ignore[method-assign]  # noted, then sent as ever
        rtt = await round_trip(conn)
        conn.send_packet = send  # type: ignore[method-assign]
        # upstream's private call, pinned: sshd refuses keepalive@openssh.com, and answers
        kind, _ = await conn._make_global_request(b"keepalive@openssh.com")
        return rtt, kind, sent


@pytest.mark.slow
def test_the_round_trip_is_the_links_not_a_logins(
        slurm_stack: Any, proxied: tuple[int, str]) -> None:  # type: ignore[no-untyped-def]
    _, kind, direct = asyncio.run(_measure(slurm_stack, slurm_stack.clusters["alpha"].ssh_port,
                                           slurm_stack.known_hosts))
    assert kind == MSG_REQUEST_FAILURE
    delayed, _, sent = asyncio.run(_measure(slurm_stack, *proxied))
    # a probe that did not wait for sshd's answer would time nothing (~0 through the proxy),
    # and one that waited for it cannot take less than the proxy's round trip, which sleeps
    # RTT_MS: a lower bound however slow the machine (no upper one: a loaded machine may
    # hold up any wait). What was timed is one round trip per probe, not a login: the
    # client sent one packet per probe, the keepalive global request, and no channel open
    # or exec request (a command waits for two of sshd's answers, and starts a shell)
    assert delayed >= RTT_MS / 1e3
    assert sent == direct == [MSG_GLOBAL_REQUEST] * RTT_PROBES, (sent, direct)
    assert streams_for_rtt(delayed, 4) == 4


@pytest.mark.slow
def test_a_copy_through_a_long_round_trip_uses_every_stream(
        slurm_stack: Any, proxied: tuple[int, str],  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    port, known = proxied
    site = Path(slurm_stack.clusters["alpha"].work_dir) / f"rtt-{tmp_path.name}"
    site.mkdir(parents=True)
    (site / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (site / "config.json").write_text("{}")

    async def copy() -> XfflSshConnector:
        node = f"127.0.0.1:{port}"
        conn = XfflSshConnector(deployment_name="rtt", config_dir=str(tmp_path), nodes=[node],
                                username=slurm_stack.user, sshKey=slurm_stack.ssh_key,
                                knownHosts=known, copyStreams=3)
        make = conn._copier

        def copier(location: ExecutionLocation) -> Copier:
            copiers.append(make(location))
            return copiers[-1]

        conn._copier = copier  # type: ignore[method-assign]
        try:
            await conn.copy_remote_to_local(str(site), str(tmp_path / "back"),
                                            ExecutionLocation(node, "rtt", local=False))
        finally:
            await conn.undeploy(False)
        return conn

    copiers: list[Copier] = []
    try:
        conn = asyncio.run(copy())
    finally:
        subprocess.run(["rm", "-rf", str(site)], check=True)
    (rtt,) = conn.rtt.values()
    assert rtt >= RTT_MS / 1e3  # measured once, on the proxied link
    # 200 ms needs 100 windows of 2 MiB to cover 1 GB/s: every stream the profile allows
    assert [c.streams for c in copiers] == [3] and copiers[0].rtt == rtt
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == bytes(range(256)) * 4096
    assert (tmp_path / "back" / "config.json").read_text() == "{}"
