"""Benchmark: an update copied site -> coordinator (copy-back) and coordinator -> site
(copy-out) through xffl's StreamFlow connector (``xffl-ssh``) beside ``scp``, ``rsync`` and
``cp``, against the test stack's sshd, at emulated round-trip times.

The round trip is bench/transfer/proxy.py (a delaying TCP proxy on 127.0.0.1, half the
RTT each way; ``tc netem`` is not available here) in front of cluster alpha's sshd port;
0 ms is the sshd port itself. Each copy runs as a child process of its own: its wall time
gives MB/s, its CPU time (user + system, children included, from ``wait4``) the
coordinator's CPU seconds per GB (the sshd serving it is the site's). xffl's copies run
with 1, 2 and 4 streams (``transfer.streams`` with ``streams_from_rtt: false``) and as a
profile has them by default (``xffl``: at most 4 streams, as many as the measured round
trip needs, one up to 2.1 ms); ``asyncssh`` is the same copy as one plain
asyncssh channel per file (``cat``, xffl-ssh's connection settings, none of xffl's
protocol): what the library itself allows, to tell xffl's costs from asyncssh's. The
update is ``--size-mib`` MiB of random bytes in one ``model.safetensors`` (``--shards N``: N
files of that size each) beside a config.json. The baseline of every ratio, ``scp``, runs
in the same invocation and at the same RTT. ``--busy N`` keeps N more processes spinning on
the CPU during each copy (the coordinator's CPU contended: the same for ``scp`` and for
xffl; this machine has 2 cores); ``--repeat N`` runs every method N times, interleaved, and
compares medians. The last lines, one per direction, RTT and stream count, read::

    copy-back rtt=50ms 1 stream: 1.07x scp, CPU 0.98x scp's
    copy-back rtt=50ms default (4 of 4 streams): 3.12x scp, CPU 0.71x scp's

    python bench/transfer/run.py                       # 1 GiB, rtt 0/20/50 ms
    python bench/transfer/run.py --shards 4 --rtt 50   # a sharded 4 GiB update at 50 ms
    python bench/transfer/run.py --busy 4 --repeat 3 --methods scp asyncssh "xffl 1"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xffl.site_profiles.schema import SshTransfer

REPO = Path(__file__).resolve().parents[2]
PROXY = Path(__file__).resolve().parent / "proxy.py"
STREAMS = (1, 2, 4)
DEFAULT_STREAMS = SshTransfer().streams  # a profile's transfer.streams


def _child_copy(args: argparse.Namespace) -> None:
    """One copy through xffl-ssh (run as this script's child: ``--child``)."""
    from streamflow.core.deployment import ExecutionLocation

    from xffl.workflows.extensions.ssh import XfflSshConnector

    async def main() -> None:
        start, cpu = time.perf_counter(), time.process_time()
        node = f"127.0.0.1:{args.port}"
        conn = XfflSshConnector(deployment_name="bench", config_dir=tempfile.gettempdir(),
                                nodes=[node], username=args.user, sshKey=args.key,
                                knownHosts=args.known_hosts, transferBufferSize=4 << 20,
                                copyStreams=args.streams, copyStreamsFromRtt=args.from_rtt,
                                maxConnections=1 + args.streams // 8)
        copiers: list[Any] = []  # each copy's copier: the streams it used
        make = conn._copier

        def copier(location: ExecutionLocation) -> Any:
            copiers.append(make(location))
            return copiers[-1]

        conn._copier = copier  # type: ignore[method-assign]
        loc = ExecutionLocation(name=node, deployment="bench", local=False)
        if args.direction == "back":
            await conn.copy_remote_to_local(args.src, args.dst, loc)
        else:
            await conn.copy_local_to_remote(args.src, args.dst, [loc])
        await conn.undeploy(False)
        print(json.dumps({"seconds": time.perf_counter() - start,
                          "cpu": time.process_time() - cpu,
                          "streams": copiers[-1].streams}))  # the copy's (not the
        # destination check's, a copy-out's first)

    asyncio.run(main())


def _child_raw(args: argparse.Namespace) -> None:
    """The same copy as one plain asyncssh channel per file (``cat``), with xffl-ssh's
    connection settings and no xffl protocol: what asyncssh itself costs (``--raw``)."""
    import asyncssh

    from xffl.workflows.extensions.connection import COPY_PACKET, COPY_WINDOW

    async def main() -> None:
        start, cpu = time.perf_counter(), time.process_time()
        conn = await asyncssh.connect(
            "127.0.0.1", port=int(args.port), username=args.user, client_keys=[args.key],
            known_hosts=args.known_hosts, compression_algs=None,
            encryption_algs=["aes128-gcm@openssh.com"], window=COPY_WINDOW,
            max_pktsize=COPY_PACKET)
        async with conn:
            if args.direction == "back":
                os.makedirs(args.dst, exist_ok=True)
                names = (await conn.run(f"ls {args.src}", check=True)).stdout.split()
                for name in names:
                    proc = await conn.create_process(f"cat {args.src}/{name}", encoding=None)
                    with open(os.path.join(args.dst, name), "wb") as out:
                        while chunk := await proc.stdout.read(4 << 20):
                            out.write(chunk)
                    await proc.wait()
            else:
                await conn.run(f"mkdir -p {args.dst}", check=True)
                for name in sorted(os.listdir(args.src)):
                    proc = await conn.create_process(f"cat > {args.dst}/{name}", encoding=None)
                    with open(os.path.join(args.src, name), "rb") as f:
                        while chunk := f.read(4 << 20):
                            proc.stdin.write(chunk)
                            await proc.stdin.drain()
                    proc.stdin.write_eof()
                    await proc.wait()
        print(json.dumps({"seconds": time.perf_counter() - start,
                          "cpu": time.process_time() - cpu}))

    asyncio.run(main())


def _timed(argv: list[str]) -> tuple[float, float, int | None]:
    """(wall s, CPU s of the process and its children, streams used) of ``argv``; it must
    exit 0. An xffl child reports its own from its first connection on (a coordinator has
    xffl imported), and the streams its copy used."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise RuntimeError(f"{argv[0]} exited {status}: {err.read()[-2000:]!r}")
        out.seek(0)
        said = out.read().decode().strip().splitlines()
    if "--child" in argv:
        own = json.loads(said[-1])
        return float(own["seconds"]), float(own["cpu"]), own.get("streams")
    return wall, usage.ru_utime + usage.ru_stime, None


def _ssh_opts(stack: Any, known_hosts: str) -> list[str]:
    return ["-i", stack.ssh_key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR"]


def _methods(stack: Any, port: int, known_hosts: str, direction: str, site: str,
             here: str, streams: tuple[int, ...]) -> dict[str, list[str]]:
    """argv of each method copying ``site`` (at the site) and ``here`` in ``direction``."""
    user = stack.user
    remote = f"{user}@127.0.0.1:{site}"
    src, dst = (remote, here) if direction == "back" else (here, remote)
    ssh = " ".join(["ssh", "-p", str(port), *_ssh_opts(stack, known_hosts)])
    out = {"scp": ["scp", "-r", "-q", "-P", str(port), *_ssh_opts(stack, known_hosts),
                   src, dst]}
    if shutil.which("rsync"):  # the site's rsync too: the stack's sshd is this machine
        out["rsync"] = ["rsync", "-a", "--whole-file", "-e", ssh, src + "/",
                        dst.rstrip("/") + "/"]
    out["asyncssh"] = [sys.executable, __file__, "--child", "--raw", "--direction", direction,
                       "--port", str(port), "--user", user, "--key", stack.ssh_key,
                       "--known-hosts", known_hosts, "--streams", "1",
                       "--src", site if direction == "back" else here,
                       "--dst", here if direction == "back" else site]
    xffl = [sys.executable, __file__, "--child", "--direction", direction,
            "--port", str(port), "--user", user, "--key", stack.ssh_key,
            "--known-hosts", known_hosts, "--src", site if direction == "back" else here,
            "--dst", here if direction == "back" else site]
    out["xffl"] = [*xffl, "--streams", str(DEFAULT_STREAMS), "--from-rtt"]  # the default
    for n in streams:  # a fixed number of streams (transfer.streams_from_rtt: false)
        out[f"xffl {n}"] = [*xffl, "--streams", str(n)]
    return out


@contextlib.contextmanager
def _busy(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _update(folder: Path, size_mib: int, shards: int) -> int:
    """Write the benchmark's update; its bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    block = os.urandom(1 << 20)
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}" \
            ".safetensors"
        with open(folder / name, "wb") as f:
            for _ in range(size_mib):
                f.write(block)
    return sum(p.stat().st_size for p in folder.iterdir())


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method at every RTT in both directions; one row each."""
    sys.path.insert(0, str(REPO))
    from tests.stack import stack as stack_mod

    info = stack_mod.up(Path(args.stack_dir)) if args.stack_dir else \
        stack_mod.up(stack_mod.default_dir())
    port0 = info.clusters["alpha"].ssh_port
    key = Path(info.host_key_pub).read_text().split()[:2]
    work = Path(tempfile.mkdtemp(prefix="xffl-bench-transfer-"))
    site_root = Path(info.clusters["alpha"].work_dir) / f"bench-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    try:
        nbytes = _update(site_root / "update", args.size_mib, args.shards)
        _update(work / "global", args.size_mib, args.shards)
        if not args.no_cp:
            for direction in ("back", "out"):
                src, dst = ((site_root / "update", work / "cp") if direction == "back"
                            else (work / "global", site_root / "cp"))
                wall, cpu, _ = _timed(["cp", "-r", str(src), str(dst)])
                shutil.rmtree(dst)
                rows.append(_row(direction, 0, "cp", wall, cpu, nbytes, 0))
        for rtt in args.rtt:
            proxy = None
            if rtt:
                proxy = subprocess.Popen([sys.executable, str(PROXY), str(port0), str(rtt)],
                                         stdout=subprocess.PIPE, text=True)
                assert proxy.stdout is not None
                port = int(proxy.stdout.readline())
            else:
                port = port0
            known = work / f"known_hosts-{port}"
            known.write_text(f"[127.0.0.1]:{port} {' '.join(key)}\n")
            try:
                for direction in ("back", "out"):
                    site = str(site_root / ("update" if direction == "back" else "global"))
                    here = str(work / ("update" if direction == "back" else "global"))
                    methods = [(name, argv) for name, argv in _methods(
                        info, port, str(known), direction, site, here,
                        tuple(args.streams)).items() if not args.methods or name in args.methods]
                    for _ in range(args.repeat):  # every method once, then again: a drift in
                        for name, argv in methods:  # the machine's load touches them all
                            dst = Path(here if direction == "back" else site)
                            shutil.rmtree(dst, ignore_errors=True)
                            with _busy(args.busy):
                                wall, cpu, used = _timed(argv)
                            rows.append({**_row(direction, rtt, name, wall, cpu, nbytes,
                                                args.busy), "streams_used": used})
                            print(_line(rows[-1]), file=sys.stderr, flush=True)
            finally:
                if proxy is not None:
                    proxy.kill()
                    proxy.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(site_root, ignore_errors=True)
    return rows


def _row(direction: str, rtt: int, method: str, wall: float, cpu: float,
         nbytes: int, busy: int) -> dict[str, Any]:
    return {"direction": direction, "rtt_ms": rtt, "method": method, "seconds": wall,
            "mb_s": nbytes / wall / 1e6, "cpu_s_per_gb": cpu / (nbytes / 1e9), "bytes": nbytes,
            "busy": busy}


def _line(r: dict[str, Any]) -> str:
    used = f" ({r['streams_used']} streams)" if r["method"] == "xffl" else ""
    return (f"copy-{r['direction']:<4} rtt={r['rtt_ms']:>2}ms {r['method']:<7} "
            f"{r['seconds']:7.2f} s {r['mb_s']:8.1f} MB/s {r['cpu_s_per_gb']:6.2f} CPU-s/GB"
            f"{used}")


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per direction, RTT and method: the median of its runs' seconds and CPU
    (``runs``: how many; ``seconds_all``: each run's, in order)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["direction"], r["rtt_ms"], r["method"]), []).append(r)
    out = []
    for runs in groups.values():
        wall = statistics.median(r["seconds"] for r in runs)
        cpu_gb = statistics.median(r["cpu_s_per_gb"] for r in runs)
        nbytes = runs[0]["bytes"]
        out.append({**runs[0], "seconds": wall, "mb_s": nbytes / wall / 1e6,
                    "cpu_s_per_gb": cpu_gb, "runs": len(runs),
                    "seconds_all": [r["seconds"] for r in runs]})
    return out


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The table, then ``copy-back rtt=50ms 1 stream: 1.07x scp`` lines (and CPU ratios),
    of each method's median run."""
    rows = medians(rows)
    lines = [_line(r) for r in rows]
    for r in rows:
        if r["method"] == "asyncssh":  # what one plain asyncssh channel does, for reference
            (scp,) = [s for s in rows if s["method"] == "scp" and
                      s["direction"] == r["direction"] and s["rtt_ms"] == r["rtt_ms"]]
            lines.append(f"copy-{r['direction']} rtt={r['rtt_ms']}ms asyncssh 1 channel: "
                         f"{scp['seconds'] / r['seconds']:.2f}x scp, "
                         f"CPU {r['cpu_s_per_gb'] / scp['cpu_s_per_gb']:.2f}x scp's")
        if not r["method"].startswith("xffl"):
            continue
        (scp,) = [s for s in rows if s["method"] == "scp" and s["direction"] == r["direction"]
                  and s["rtt_ms"] == r["rtt_ms"]]
        if r["method"] == "xffl":
            what = f"default ({r['streams_used']} of {DEFAULT_STREAMS} streams)"
        else:
            n = int(r["method"].split()[1])
            what = f"{n} stream{'' if n == 1 else 's'}"
        lines.append(f"copy-{r['direction']} rtt={r['rtt_ms']}ms {what}: "
                     f"{scp['seconds'] / r['seconds']:.2f}x scp, "
                     f"CPU {r['cpu_s_per_gb'] / scp['cpu_s_per_gb']:.2f}x scp's")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--child``, one xffl copy)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--rtt", type=int, nargs="+", default=[0, 20, 50], help="ms")
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--stack-dir", default=None, help="the test stack's folder")
    p.add_argument("--no-cp", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="runs of every method (the "
                   "ratios compare medians)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU "
                   "during each copy")
    p.add_argument("--methods", nargs="+", default=None, help="only these (scp, rsync, "
                   "'xffl N')")
    p.add_argument("--json", action="store_true")
    for name in ("--direction", "--port", "--user", "--key", "--known-hosts", "--src",
                 "--dst"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--from-rtt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.streams = int(args.streams[0])
        (_child_raw if args.raw else _child_copy)(args)
        return 0
    rows = run(args)
    print(json.dumps(medians(rows), indent=1) if args.json else "\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
