"""The steps of the one-GPU check: ``python steps.py STEP[,STEP...] --work W --out O``.

Each step writes ``O/STEP.json`` ({"ok": bool, ...numbers}; a step that raised: ok false and
the traceback's tail), and the process exits 0; the driver (run.py) judges ``ok``, keeps each
step (on the GPU) or the whole CPU dry run under its timeout and prints the summary.
The steps use xffl's own code paths: round 0 as ``xffl render`` writes it, the per-rank
trainer started through ``xffl.training.launch`` (as a batch script does), the coordinator's
admission checks and FedAvg, the sharded loader and ``train_round`` under a one-rank group.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from shapes import LOSS_DROP, SHAPES, Shape  # noqa: E402

RUN_ID = "gpu-check"


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _job(shape: Shape, data: Path, **training: Any) -> dict[str, Any]:
    """A TrainJob (what the plan writes for one site and round) of ``shape``."""
    return {"run_id": RUN_ID, "site": "gpu", "rounds": 1, "model": shape.model(),
            "training": shape.training(**training),
            "data": {"path": str(data), "synthetic": "alpha",
                     "synthetic_sequences": shape.sequences()}}


def _global0(shape: Shape, out: Path) -> dict[str, Any]:
    """Round 0 of ``shape`` as ``xffl render`` writes it (seeded, streamed)."""
    from xffl.training.checkpoint import init_global
    from xffl.training.config import ModelSpec

    began = time.perf_counter()
    if not (out / "manifest.json").is_file():
        init_global(RUN_ID, ModelSpec(**shape.model()), 0, out)
    manifest = _load_json(out / "manifest.json")
    return {"seconds": round(time.perf_counter() - began, 2),
            "parameters": manifest["extra"]["num_parameters"]}


def _launch(job: dict[str, Any], work: Path, name: str, model: Path, data: Path,
            env: dict[str, str] | None = None, base: Path | None = None) -> dict[str, Any]:
    """One round through xffl's launcher, one rank; the update's manifest and the log."""
    job_file, update = work / f"{name}.job.json", work / f"{name}.update"
    job_file.write_text(json.dumps(job))
    shutil.rmtree(update, ignore_errors=True)
    argv = [sys.executable, "-m", "xffl.training.launch", "--ranks", "1", "--launcher", "none",
            "--", "--job", str(job_file), "--round", "1", "--model", str(model),
            "--data", str(data), "--out", str(update)]
    if base is not None:
        argv += ["--base", str(base)]
    began = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = {"rc": proc.returncode,
                              "wall_s": round(time.perf_counter() - began, 2)}
    if proc.returncode != 0:
        result["error"] = (proc.stderr or proc.stdout)[-2000:]
        return result
    manifest = _load_json(update / "manifest.json")
    result.update(update=str(update), metrics=manifest["metrics"], extra=manifest["extra"])
    return result


def _estimate(job: dict[str, Any], mode: str, data_parallel: str | None = None) -> float:
    """The memory model's peak GiB per rank for ``job`` on one rank (what xffl validate
    prints), on a GPU or, in the dry run, the CPU variant."""
    from xffl.training.arch import build_config
    from xffl.training.config import TrainJob
    from xffl.training.memory_model import estimate, model_parts, site_layout

    spec = TrainJob.model_validate(job)
    parts = model_parts(build_config(spec.model), spec.training.lora)
    layout = site_layout(spec.training, 1, parts, gpu=mode == "full",
                         data_parallel=data_parallel)
    return round(estimate(parts, layout).gib, 3)


def _smi(out: Path) -> subprocess.Popen[bytes] | None:
    """nvidia-smi sampling GPU use to out/smi.csv every 0.5 s (None without a GPU)."""
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used,power.draw",
         "--format=csv", "-lms", "500", "-f", str(out / "smi.csv")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def step_init(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """Round 0 of the dense and the small model."""
    shapes = SHAPES[mode]
    return {"ok": True, "dense": _global0(shapes["dense"], work / "dense-g0"),
            "small": _global0(shapes["small"], work / "small-g0")}


def step_dense(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """(a, b) the dense model's round in bf16 through the launcher: the loss falls."""
    shape = SHAPES[mode]["dense"]
    # "auto" is bf16 on a GPU; the dry run asks bf16 of the CPU, so it takes the same path
    job = _job(shape, work / "data-dense", precision="auto" if mode == "full" else "bf16")
    smi = _smi(out)
    try:
        result = _launch(job, work, "dense", work / "dense-g0", work / "data-dense")
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait(timeout=10)
    result["estimate_gib"] = _estimate(job, mode)
    if result["rc"] == 0:
        m = result["metrics"]
        result["loss_drop"] = m["loss_first"] - m["loss_last"]
        result["ok"] = result["loss_drop"] > LOSS_DROP[mode]
    else:
        result["ok"] = False
    return result


def _admit(update: Path, previous: Path) -> dict[str, Any]:
    """The coordinator's admission of ``update`` against the global ``previous``, as
    xffl.workflows.steps.admit checks it (digest, run, round, layout, config, checksums)."""
    from xffl.aggregator.exchange import read_manifest
    from xffl.aggregator.kinds import kind_of
    from xffl.aggregator.reported import Bounds
    from xffl.aggregator.verify import UpdateRejected, check_update
    from xffl.workflows.steps.admit import SIDE_FILES

    parent = read_manifest(previous)
    kind = kind_of(previous)
    config = json.loads((previous / kind.config_file).read_text())
    began = time.perf_counter()
    try:
        check_update(update, expected_round=1, expected_parent=parent.digest(),
                     reference_index=parent.tensors, expected_run_id=parent.run_id,
                     expected_config=config, kind=kind, bounds=Bounds(side_files=SIDE_FILES))
    except UpdateRejected as exc:
        return {"admitted": False, "reason": exc.reason}
    return {"admitted": True, "check_s": round(time.perf_counter() - began, 2)}


def step_admit(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """(c) the GPU's update admitted and aggregated by the coordinator's own code."""
    from xffl.aggregator.fedavg import aggregate

    update, previous = work / "dense.update", work / "dense-g0"
    result = _admit(update, previous)
    if result["admitted"]:
        began = time.perf_counter()
        manifest = aggregate([update], work / "dense-g1", run_id=RUN_ID, round=1)
        result["aggregate_s"] = round(time.perf_counter() - began, 2)
        result["global_digest"] = manifest.digest()
    result["ok"] = result["admitted"]
    return result


def step_parity(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """(c) the small model's fp32 round on the GPU against the same round on the CPU."""
    import numpy as np

    from xffl.aggregator.shards import open_model

    shape = SHAPES[mode]["small"]
    job = _job(shape, work / "data-small", precision="fp32")
    gpu = _launch(job, work, "parity-gpu", work / "small-g0", work / "data-small")
    cpu = _launch(job, work, "parity-cpu", work / "small-g0", work / "data-small",
                  env={"CUDA_VISIBLE_DEVICES": ""})
    if gpu["rc"] != 0 or cpu["rc"] != 0:
        return {"ok": False, "gpu": gpu, "cpu": cpu}
    loss_gap = max(abs(a - b) for a, b in zip(gpu["extra"]["losses"], cpu["extra"]["losses"],
                                              strict=True))
    weight_gap = 0.0
    with open_model(Path(gpu["update"])) as a, open_model(Path(cpu["update"])) as b:
        names = sorted(a.names())
        same_names = names == sorted(b.names())
        for name in names if same_names else []:
            gap = np.abs(a.read(name).astype(np.float64) - b.read(name).astype(np.float64))
            weight_gap = max(weight_gap, float(gap.max()))
    # the loss curves of fp32 on two devices differ by rounding only (TF32 is off in torch
    # by default for matmuls): 1e-4 of a loss near 5 is ~1000 ulp, far above that, far below
    # a real difference (a wrong mask or dtype moves the loss by > 1e-2). The weights are
    # reported, not gated: AdamW moves a weight by up to 2 lr when a near-zero gradient flips
    return {"ok": same_names and loss_gap < 1e-4, "same_names": same_names,
            "loss_gap": loss_gap, "max_weight_gap": weight_gap,
            "gpu_device": gpu["extra"].get("device"), "cpu_device": cpu["extra"].get("device")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peak_gib(device: Any) -> float:
    """Peak memory of this process: the GPU's allocator, else the host's resident set."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def step_fsdp1(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """(d) FSDP2 + activation checkpointing on a one-rank NCCL (gloo) group: the sharded
    load equals the checkpoint bit for bit, and ``train_round`` trains."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from xffl.aggregator.shards import open_model
    from xffl.training.checkpoint import read_config
    from xffl.training.config import TrainJob
    from xffl.training.sharded_load import load_parallel
    from xffl.training.trainer import train_round

    shape = SHAPES[mode]["dense"]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    model_dir = work / "dense-g0"
    config = read_config(model_dir)
    precision = "auto" if mode == "full" else "bf16"
    pm = load_parallel(model_dir, config, 1, device, "fsdp", 1, precision=precision)
    units = sum(isinstance(m, FSDPModule) for m in pm.module.modules())
    exact = True
    with open_model(model_dir) as reader:
        names = set(reader.names())
        for name, param in pm.module.state_dict().items():
            if name not in names:
                continue
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if not np.array_equal(full.detach().cpu().numpy(), reader.read(name)):
                exact = False
    del pm
    load_peak = _peak_gib(device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    raw = _job(shape, work / "data-dense", data_parallel="fsdp",
               activation_checkpointing=True, precision=precision)
    job = TrainJob.model_validate(raw)
    began = time.perf_counter()
    manifest = train_round(job, 1, model_dir, work / "data-dense", work / "fsdp.update")
    seconds = time.perf_counter() - began
    dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the next step's trainers start afresh
        os.environ.pop(key, None)
    losses = manifest.extra["losses"]
    dense = _load_json(out / "dense.json")
    plain = dense.get("extra", {}).get("losses", [])
    # bf16 rounding of two wrappings of the same math (FSDP2's mixed precision, autocast):
    # the first steps' losses agree to a few hundredths; a layer missing from the model or
    # a wrong load moves them by tenths
    gap = max((abs(a - b) for a, b in zip(losses[:10], plain[:10], strict=False)), default=0.0)
    admitted = _admit(work / "fsdp.update", model_dir)
    layers = int(config.hf.num_hidden_layers)
    return {"ok": exact and units == layers + 1 and gap < 0.05 and admitted["admitted"],
            "sharded_load_exact": exact, "fsdp_units": units, "layers": layers,
            "loss_gap_vs_plain": gap, "admitted": admitted, "round_s": round(seconds, 2),
            "load_peak_gib": round(load_peak, 3), "round_peak_gib": round(_peak_gib(device), 3),
            # FSDP2 over one rank: the model's fsdp layout at dp 1
            "estimate_gib": _estimate(raw, mode, data_parallel="fsdp"),
            "metrics": manifest.metrics}


def _base_dir(mode: str, work: Path) -> Path:
    """Where the 8B base goes: /dev/shm when it has 40 GB free (no disk in the way)."""
    shm = Path("/dev/shm")
    if mode == "full" and shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30:
        return shm / "xffl-gpu-check-base"
    return work / "lora-base"


def step_lora(mode: str, work: Path, out: Path) -> dict[str, Any]:
    """(e) a LoRA round (r 16 on q, k, v, o, activation checkpointing) on a seeded base."""
    from xffl.training.config import LoraSpec, ModelSpec
    from xffl.training.lora import init_adapter_global

    shape = SHAPES[mode]["lora"]
    base = _base_dir(mode, work)
    seeded = _global0(shape, base)
    spec = LoraSpec(r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    adapter = work / "lora-g0"
    if not (adapter / "manifest.json").is_file():
        init_adapter_global(RUN_ID, ModelSpec(**shape.model()), spec, 0, adapter, str(base))
    job = _job(shape, work / "data-lora", lora=spec.model_dump(mode="json"),
               activation_checkpointing=True, precision="auto" if mode == "full" else "bf16")
    smi = _smi(out)
    try:
        result = _launch(job, work, "lora", adapter, work / "data-lora", base=base)
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait(timeout=10)
    result["base"] = seeded
    result["estimate_gib"] = _estimate(job, mode)
    if result["rc"] == 0:
        result["admitted"] = _admit(Path(result["update"]), adapter)
        result["ok"] = result["admitted"]["admitted"]
    else:
        result["ok"] = False
    if mode == "full":
        shutil.rmtree(base, ignore_errors=True)
    return result


STEPS = {"init": step_init, "dense": step_dense, "admit": step_admit, "parity": step_parity,
         "fsdp1": step_fsdp1, "lora": step_lora}


def main() -> int:
    """Run the steps given (comma-separated, in turn) and write each one's JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("steps", help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--mode", choices=sorted(SHAPES), default="full")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    steps = args.steps.split(",")
    if unknown := [s for s in steps if s not in STEPS]:
        parser.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for step in steps:
        began = time.perf_counter()
        try:
            result = STEPS[step](args.mode, args.work, args.out)
        except Exception:  # this step failed; the next ones in this process still run
            result = {"ok": False, "error": traceback.format_exc()[-1500:]}
        result["step_s"] = round(time.perf_counter() - began, 1)
        (args.out / f"{step}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
