"""Benchmark: streaming aggregation against the disk's I/O floor and a load-everything baseline.

Generates N fp32 updates (default 16 tensors x 64 MiB = 1 GiB each), then runs every mode in
its own child process, with the inputs evicted from the page cache first (unless --warm):

  floor     read every input file while writing one output of the same size (+ fsync): the
            pure I/O of an aggregation, no compute, no hashing
  xffl      xffl.aggregator.fedavg.aggregate() (FedAvg + hashed output + manifest + fsync)
  verify    xffl.aggregator.verify.select_updates() (sha256 + NaN/Inf scan of every input)
  baseline  safetensors.torch.load_file of every update, average in memory, save_file + fsync

and reports wall time and peak RSS (the child's VmHWM: its whole footprint, imports included).

    python bench/aggregate/run.py --updates 4            # 4 GiB of inputs
    python bench/aggregate/run.py --tensor-mib 4 --tensors 4   # a quick run
    python bench/aggregate/run.py --updates 4,8 --modes floor,xffl   # RSS vs update count
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.exchange import Manifest, finalize_manifest, staged_dir
from xffl.aggregator.safetensors_io import SafetensorsWriter
from xffl.aggregator.shards import MODEL_FILE

MODES = ("floor", "xffl", "verify", "baseline")
MiB = 1 << 20
_IO_CHUNK = 8 * MiB


def generate(base: Path, updates: int, tensors: int, tensor_mib: int) -> list[Path]:
    """Write ``updates`` update checkpoints of ``tensors`` fp32 tensors of ``tensor_mib`` MiB."""
    numel = tensor_mib * MiB // 4
    rows = 1024 if numel % 1024 == 0 else 1
    shape = (rows, numel // rows)
    entries = [(f"layers.{i:02d}.weight", "F32", shape) for i in range(tensors)]
    rng = np.random.default_rng(0)
    dirs = []
    for u in range(updates):
        d = base / f"update-{u}"
        with staged_dir(d) as tmp:
            with SafetensorsWriter(tmp / MODEL_FILE, entries, {"format": "pt"}) as w:
                for name, _, _ in entries:
                    w.write(name, rng.standard_normal(shape, dtype=np.float32))
            (tmp / "config.json").write_text('{"model_type": "bench"}')
            finalize_manifest(
                tmp,
                Manifest(
                    kind="update",
                    run_id="bench",
                    round=1,
                    site=f"site-{u}",
                    num_samples=100 + 37 * u,
                    metrics={"loss": 1.0 + u},
                ),
                checksums={MODEL_FILE: w.sha256},
            )
        dirs.append(d)
    return dirs


def evict(paths: list[Path]) -> None:
    """Drop files from the page cache (clean pages), so the next reader goes to the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _write_like(out: Path, size: int) -> None:
    """Write ``size`` bytes in 8 MiB chunks with the aggregator's writeback hint, then fsync."""
    chunk = np.random.default_rng(1).integers(0, 256, _IO_CHUNK, dtype=np.uint8).data
    with out.open("wb", buffering=0) as fo:
        written = flushed = 0
        while written < size:
            n = min(_IO_CHUNK, size - written)
            written += fo.write(chunk[:n])
            if written - flushed >= 64 * MiB:  # same writeback hint as the aggregator
                os.posix_fadvise(fo.fileno(), flushed, written - flushed, os.POSIX_FADV_DONTNEED)
                flushed = written
        os.fsync(fo.fileno())


def _floor(dirs: list[Path], out: Path) -> None:
    """Pure I/O: read every input sequentially while a thread writes an input-sized output."""
    out.mkdir()
    size = (dirs[0] / MODEL_FILE).stat().st_size
    writer = threading.Thread(target=_write_like, args=(out / MODEL_FILE, size))
    writer.start()
    view = memoryview(bytearray(_IO_CHUNK))
    for d in dirs:
        with (d / MODEL_FILE).open("rb", buffering=0) as f:
            pos = 0
            while True:  # ask for the next chunk before reading this one, as xffl does
                os.posix_fadvise(f.fileno(), pos + _IO_CHUNK, _IO_CHUNK, os.POSIX_FADV_WILLNEED)
                n = f.readinto(view)
                if not n:
                    break
                pos += n
    writer.join()


def _baseline(dirs: list[Path], out: Path) -> None:
    """The load-everything approach: every update in RAM, then average and save."""
    import torch
    from safetensors.torch import load_file, save_file

    from xffl.aggregator.exchange import read_manifest

    weights = [float(read_manifest(d).num_samples) for d in dirs]
    models = [load_file(str(d / MODEL_FILE)) for d in dirs]
    avg: dict[str, torch.Tensor] = {}
    for name in models[0]:
        acc = models[0][name].double() * weights[0]
        for m, w in zip(models[1:], weights[1:], strict=True):
            acc += m[name].double() * w
        avg[name] = (acc / sum(weights)).to(models[0][name].dtype)
    out.mkdir()
    save_file(avg, str(out / MODEL_FILE), metadata={"format": "pt"})
    fd = os.open(out / MODEL_FILE, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def child(
    mode: str, dirs: list[Path], out: Path, max_shard_size: str | None = None
) -> dict[str, Any]:
    """Run one mode in this process and return its wall time (imports done beforehand)."""
    from xffl.aggregator.fedavg import aggregate
    from xffl.aggregator.verify import select_updates

    if mode == "baseline":
        import safetensors.torch  # noqa: F401  (torch's import time is not the baseline's)
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    if mode == "floor":
        _floor(dirs, out)
    elif mode == "xffl":
        aggregate(dirs, out, max_shard_size=max_shard_size)
    elif mode == "verify":
        accepted, rejected = select_updates(dirs)
        info = {"accepted": len(accepted), "rejected": len(rejected)}
    elif mode == "baseline":
        _baseline(dirs, out)
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mib": _vm_hwm_mib(), **info}


def _vm_hwm_mib() -> float:
    """This process's peak RSS (VmHWM), which exec resets, unlike the ru_maxrss of wait4."""
    # ru_maxrss would carry the parent's footprint over from fork+exec (signal->maxrss).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(
    mode: str, dirs: list[Path], out: Path, warm: bool, max_shard_size: str | None = None
) -> dict[str, Any]:
    """Run ``mode`` in a fresh child process; it reports its wall time and peak RSS."""
    if not warm:
        evict([d / MODEL_FILE for d in dirs])
    cmd = [sys.executable, __file__, "--child", mode, "--out", str(out)]
    if max_shard_size is not None:
        cmd += ["--max-shard-size", max_shard_size]
    cmd += [str(d) for d in dirs]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    text = proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{mode} child failed with exit code {proc.returncode}")
    result: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Generate the updates, measure every mode, print the table and the ratios."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--updates",
        default="4",
        help="number of updates; a comma-separated list (4,8) runs each and compares them",
    )
    p.add_argument("--tensor-mib", type=int, default=64)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where to put the generated data (a temp dir inside it)",
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of modes")
    p.add_argument("--warm", action="store_true", help="do not evict inputs from the page cache")
    p.add_argument("--keep", action="store_true", help="keep the generated data")
    p.add_argument("--repeat", type=int, default=1, help="run the modes K times (median time)")
    p.add_argument("--reuse", type=Path, help="use the updates kept by an earlier --keep run")
    p.add_argument(
        "--max-shard-size",
        help="xffl mode: write the global as Hugging Face shards of at most this size "
        "(e.g. 256MB; default one file, like the floor's output)",
    )
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("inputs", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.inputs, args.out, args.max_shard_size)))
        return 0

    counts = [int(n) for n in str(args.updates).split(",") if n.strip()]
    if args.reuse:
        counts = counts[:1]
    summary: dict[int, dict[str, dict[str, Any]]] = {}
    for n in counts:
        if len(counts) > 1:
            print(f"== {n} updates", flush=True)
        args.updates = n
        results = run(args)
        summary[args.updates] = results
    if len(summary) > 1:
        compare(summary)
    return 0


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Generate (or reuse) args.updates updates, measure every mode, print the table."""
    update_bytes = args.tensors * args.tensor_mib * MiB
    if args.reuse:
        base = args.reuse
        dirs = sorted(base.glob("update-*"))
        args.updates = len(dirs)
        update_bytes = (dirs[0] / MODEL_FILE).stat().st_size
        print(f"reusing {len(dirs)} updates of {update_bytes / 2**30:.2f} GiB under {base}")
    else:
        need = (args.updates + 2) * update_bytes
        free = shutil.disk_usage(args.dir).free
        if free < need:
            raise SystemExit(f"need {need / 2**30:.1f} GiB in {args.dir}, have {free / 2**30:.1f}")
        base = Path(tempfile.mkdtemp(prefix="xffl-bench-", dir=args.dir))
    try:
        if not args.reuse:
            t0 = time.perf_counter()
            dirs = generate(base, args.updates, args.tensors, args.tensor_mib)
            print(
                f"generated {args.updates} updates of {args.tensors} x {args.tensor_mib} MiB "
                f"fp32 ({update_bytes / 2**30:.2f} GiB each) in {time.perf_counter() - t0:.1f} s"
                f" under {base}"
            )
        cache = "warm" if args.warm else "evicted before each run"
        print(f"page cache: {cache}; every run in a fresh child process; {os.cpu_count()} CPUs")
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(args.repeat):
            for mode in args.modes.split(","):
                r = measure(mode, dirs, base / f"out-{mode}", args.warm, args.max_shard_size)
                runs.setdefault(mode, []).append(r)
                moved = update_bytes * (args.updates + (0 if mode == "verify" else 1))
                print(
                    f"{mode:<9} wall {r['wall_s']:7.2f} s   {moved / r['wall_s'] / 1e9:5.2f} GB/s "
                    f"moved   peak RSS {r['peak_rss_mib']:7.0f} MiB   (run {rep + 1})",
                    flush=True,
                )
        results = {
            mode: {
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            }
            for mode, rs in runs.items()
        }
        if args.repeat > 1:
            print(f"medians over {args.repeat} runs:")
        report(results, args)
    finally:
        if args.keep or args.reuse:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    return results


def compare(summary: dict[int, dict[str, dict[str, Any]]]) -> None:
    """One line per measure comparing the runs with different numbers of updates."""
    counts = sorted(summary)
    have = [n for n in counts if "xffl" in summary[n]]
    if len(have) < 2:
        return
    rss = ", ".join(f"{n} updates {summary[n]['xffl']['peak_rss_mib']:.0f} MiB" for n in have)
    first, last = summary[have[0]]["xffl"], summary[have[-1]]["xffl"]
    print(
        f"xffl peak RSS by number of updates: {rss} "
        f"({last['peak_rss_mib'] - first['peak_rss_mib']:+.0f} MiB from {have[0]} to {have[-1]})"
    )
    ratios = [
        f"{n} updates {summary[n]['xffl']['wall_s'] / summary[n]['floor']['wall_s']:.2f}"
        for n in have
        if "floor" in summary[n]
    ]
    if ratios:
        print(f"xffl time / I/O floor by number of updates: {', '.join(ratios)}")


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the ratios the design goal is judged by."""
    budget = (3 * args.tensor_mib * MiB + 300e6) / MiB
    if "xffl" in results and "floor" in results:
        x, f = results["xffl"], results["floor"]
        print(
            f"xffl time / I/O floor: {x['wall_s'] / f['wall_s']:.2f} "
            f"({x['wall_s']:.2f} s vs {f['wall_s']:.2f} s)"
        )
    if "xffl" in results:
        x = results["xffl"]
        verdict = "within" if x["peak_rss_mib"] <= budget else "OVER"
        print(
            f"xffl peak RSS: {x['peak_rss_mib']:.0f} MiB, {verdict} the budget "
            f"3 x {args.tensor_mib} MiB + 300 MB = {budget:.0f} MiB"
        )
    if "baseline" in results:
        b = results["baseline"]
        line = f"baseline: {b['wall_s']:.2f} s, peak RSS {b['peak_rss_mib']:.0f} MiB"
        if "xffl" in results:
            x = results["xffl"]
            line += (
                f" ({b['wall_s'] / x['wall_s']:.2f}x xffl's time, "
                f"{b['peak_rss_mib'] / x['peak_rss_mib']:.1f}x its RSS)"
            )
        print(line)


if __name__ == "__main__":
    sys.exit(main())
