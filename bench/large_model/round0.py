"""Benchmark: `xffl render` of the 7B/8B example job, round 0 seeded and from a checkpoint.

For each model (the ``llama2-7b`` and ``llama3.1-8b`` presets' real shapes by default),
the job of ``examples/llama2-7b-two-facilities.yaml`` is rendered with its two sites on the
``local`` profile (no facility needed), as a subprocess whose peak RSS (``wait4``: the
largest process of its tree) and wall time are measured:

1. ``model.init: null``: round 0 seeded, streamed block by block (xffl.training.seeded);
2. ``model.init: <folder>``: a checkpoint folder the bench writes first (Hugging Face shards
   of fp32, or ``--source-dtype BF16``, plus config.json), copied/converted in pieces
   (xffl.training.streamed), timed beside ``cp -r`` of the same folder in the same run
   (page cache of the source dropped before each, dirty pages synced);
3. ``--no-init-model``: the render without round 0 (its fixed cost: imports, the plan).

Targets (issue 29): peak RSS at most 2 GiB in every case; round 0 from a checkpoint (the
render's wall time minus the render without round 0) at most 2x ``cp -r`` of the same bytes
(the whole render's ratio is printed too). Each case's output is deleted before the next (a 7B fp32
model is 27 GB; the checkpoint case needs twice that on the work folder's disk).

    .venv/bin/python bench/large_model/round0.py                          # 7B and 8B, fp32
    .venv/bin/python bench/large_model/round0.py --models llama2-7b --source-dtype BF16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from xffl.aggregator.exchange import MANIFEST_FILE
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import open_model
from xffl.training.arch import build_config
from xffl.training.config import ModelSpec
from xffl.training.streamed import expected_tensors

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llama2-7b-two-facilities.yaml"
MODELS = ("llama2-7b", "llama3.1-8b")
CHUNK = 1 << 22  # elements of the source checkpoint written at once
# The smoke test's shapes: the presets' families, layers and GQA kept, every size shrunk
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "vocab_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
         "bos_token_id": 1, "eos_token_id": 2}


def model_spec(preset: str, overrides: Mapping[str, int]) -> dict[str, Any]:
    """The job's ``model`` section for a preset (with overrides)."""
    return {"preset": preset, **({"overrides": dict(overrides)} if overrides else {})}


def write_job(workdir: Path, model: Mapping[str, Any]) -> Path:
    """The example job with ``model`` and its sites on the local profile; its path."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["model"] = dict(model)
    for site in spec["sites"]:
        site["profile"] = "local"
        site["data"] = {"path": str(workdir / "data" / site["name"])}
        (workdir / "data" / site["name"]).mkdir(parents=True, exist_ok=True)
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    return job


def measured(cmd: Sequence[str], env: Mapping[str, str]) -> dict[str, float]:
    """Run ``cmd``; its wall seconds and peak RSS in GiB (wait4: the largest process of its
    tree). SystemExit with its output if it fails."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), env=dict(env), stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{out.read().decode(errors='replace')[-3000:]}")
    return {"s": wall, "peak_gib": usage.ru_maxrss * 1024 / 2**30}


def cold(directory: Path) -> None:
    """Write dirty pages back, then drop ``directory``'s files from the page cache."""
    os.sync()
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_checkpoint(out: Path, preset: str, overrides: Mapping[str, int], dtype: str,
                     max_shard_bytes: int) -> int:
    """A Hugging Face checkpoint folder (shards + index + config.json) of the model's shapes,
    streamed; its tensor bytes."""
    config = build_config(ModelSpec.model_validate(model_spec(preset, overrides)))
    shapes = expected_tensors(config, None)
    entries = [(n, dtype, shapes[n]) for n in sorted(shapes)]
    block = np.random.default_rng(0).standard_normal(CHUNK, dtype=np.float32) * 0.02
    out.mkdir(parents=True)
    with ShardedWriter(out, entries, {"format": "pt"}, max_shard_bytes=max_shard_bytes) as w:
        for name, _, shape in entries:
            numel = math.prod(shape)
            for lo in range(0, numel, CHUNK):
                w.write_chunk(name, np.roll(block, lo % 997)[:min(CHUNK, numel - lo)])
    (out / "config.json").write_text(config.to_json())
    return sum(math.prod(s) for s in shapes.values()) * (2 if dtype == "BF16" else 4)


def same_values(source: Path, round0: Path) -> bool:
    """Spot check: the first piece of every tensor of round 0 is the source's (as fp32)."""
    with open_model(source) as a, open_model(round0) as b:
        if a.names() != b.names():
            return False
        for name in a.names():
            n = min(CHUNK, a.entry(name).numel)
            src = a.raw(name, 0, n)
            want = (src.astype(np.uint32) << 16).view(np.float32) \
                if a.entry(name).dtype == "BF16" else src
            if b.entry(name).dtype != "F32" or not np.array_equal(b.raw(name, 0, n), want):
                return False
    return True


def free_bytes(path: Path) -> int:
    """Bytes available to an unprivileged writer on ``path``'s file system."""
    return shutil.disk_usage(path).free


def bench_model(preset: str, overrides: Mapping[str, int], workdir: Path, source_dtype: str,
                max_shard_bytes: int, baseline: bool = True) -> dict[str, Any]:
    """The renders and the cp of one model; their measurements (``baseline``: also the
    render without round 0, else round 0's time is the whole render's)."""
    config = build_config(ModelSpec.model_validate(model_spec(preset, overrides)))
    shapes = expected_tensors(config, None)
    params = sum(math.prod(s) for s in shapes.values())
    fp32 = 4 * params
    src_bytes = params * (2 if source_dtype == "BF16" else 4)
    need = fp32 + src_bytes + (1 << 30)
    if free_bytes(workdir) < need:
        raise SystemExit(f"{workdir}: {free_bytes(workdir) / 2**30:.1f} GiB free, the "
                         f"{preset} cases need {need / 2**30:.1f} GiB.")
    env = {**os.environ, "XFFL_HOME": str(workdir / "home"),
           "XDG_CACHE_HOME": str(workdir / "cache")}  # the init cache: not the user's
    xffl = str(Path(sys.executable).with_name("xffl"))
    plan = workdir / "plan"
    result: dict[str, Any] = {"model": preset, "parameters": params, "fp32_bytes": fp32,
                              "source_dtype": source_dtype, "source_bytes": src_bytes}

    def render(model: Mapping[str, Any], *extra: str) -> dict[str, float]:
        job = write_job(workdir, model)
        os.sync()
        run = measured([xffl, "render", str(job), "-o", str(plan), "--force", *extra], env)
        if not extra and not (plan / "rounds" / "0" / "global" / MANIFEST_FILE).is_file():
            raise SystemExit(f"{preset}: render wrote no round 0")
        return run

    result["plan_only"] = render(model_spec(preset, overrides), "--no-init-model") \
        if baseline else {"s": 0.0, "peak_gib": 0.0}
    result["seeded"] = render(model_spec(preset, overrides))
    shutil.rmtree(plan)
    shutil.rmtree(workdir / "cache", ignore_errors=True)
    source = workdir / "checkpoint"
    t0 = time.perf_counter()
    write_checkpoint(source, preset, overrides, source_dtype, max_shard_bytes)
    result["write_source_s"] = time.perf_counter() - t0
    try:
        cold(source)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", str(source), str(workdir / "copy")], check=True)
        result["cp_s"] = time.perf_counter() - t0
        os.sync()
        result["cp_sync_s"] = time.perf_counter() - t0
        shutil.rmtree(workdir / "copy")
        cold(source)
        result["checkpoint"] = render({"init": str(source)})
        result["values_match"] = same_values(source, plan / "rounds" / "0" / "global")
    finally:
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(workdir / "copy", ignore_errors=True)
        shutil.rmtree(plan, ignore_errors=True)
    # round 0's own time: the render's minus the same render without it (imports, the plan)
    for case in ("seeded", "checkpoint"):
        result[case]["round0_s"] = max(0.0, result[case]["s"] - result["plan_only"]["s"])
    result["checkpoint_over_cp"] = result["checkpoint"]["round0_s"] / result["cp_s"]
    result["render_over_cp"] = result["checkpoint"]["s"] / result["cp_s"]
    result["peak_gib"] = max(result[k]["peak_gib"] for k in ("plan_only", "seeded", "checkpoint"))
    return result


def table(results: Sequence[Mapping[str, Any]]) -> str:
    """The results as a Markdown table."""
    rows = ["| model | parameters | fp32 GiB | render | wall s | round 0 s | peak RSS GiB "
            "| cp -r s | round 0 / cp | render / cp |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gib = r["fp32_bytes"] / 2**30
        for case, label in (("plan_only", "plan only (`--no-init-model`)"),
                            ("seeded", "seeded round 0"),
                            ("checkpoint", f"from a {r['source_dtype']} checkpoint")):
            c = r[case]
            cells = [r["model"], f"{r['parameters'] / 1e9:.2f} B", f"{gib:.1f}", label,
                     f"{c['s']:.1f}", f"{c['round0_s']:.1f}" if "round0_s" in c else "",
                     f"{c['peak_gib']:.2f}", "", "", ""]
            if case == "checkpoint":
                cells[7:] = [f"{r['cp_s']:.1f}", f"{r['checkpoint_over_cp']:.2f}",
                             f"{r['render_over_cp']:.2f}"]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run(models: Sequence[str], workdir: Path, small: bool = False, source_dtype: str = "F32",
        max_shard_bytes: int = 4 << 30, baseline: bool = True) -> list[dict[str, Any]]:
    """Benchmark every model (``small``: the smoke test's shapes); the measurements."""
    return [bench_model(m, SMALL if small else {}, workdir, source_dtype, max_shard_bytes,
                        baseline) for m in models]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse options, run, print the table and one JSON line; 1 if a target is missed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--source-dtype", choices=("F32", "BF16"), default="F32")
    parser.add_argument("--small", action="store_true", help="the smoke test's shapes")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the files go (default: a temp dir, removed afterwards)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="xffl-round0-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args.models, workdir, args.small, args.source_dtype)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(results))
    for r in results:
        print(f"{r['model']}: peak {r['peak_gib']:.2f} GiB (target <= 2); round 0 from a "
              f"checkpoint {r['checkpoint_over_cp']:.2f}x cp -r (target <= 2), the whole "
              f"render {r['render_over_cp']:.2f}x (cp -r then sync: {r['cp_sync_s']:.1f} s); "
              f"values match: {r['values_match']}")
    print(json.dumps(results))
    ok = all(r["peak_gib"] <= 2 and r["checkpoint_over_cp"] <= 2 and r["values_match"]
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
