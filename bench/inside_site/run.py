"""Benchmark: inside one site, what FSDP2, HSDP and federated node groups cost per step.

Two tables. The step table is a cost model (bench/inside_site/cost.py: compute from FLOPs,
NCCL ring collectives over the intra- and inter-node links; not a measurement) of one
training step of a model on a site of --nodes nodes: FSDP2 over all GPUs (the baseline,
computed in the same run), HSDP sharding inside groups of --group-nodes nodes, and federated
groups of --group-nodes nodes (FSDP2 inside each) averaging their weights every K steps; with
each mode's ratio to FSDP2. The GPUs per node and GPU come from the bundled facility
profile (--facility), the links from its published nominal figures (NOMINAL below; every
value is a parameter). The loss table is real: rounds of the site trainer on CPU (gloo,
4 ranks, tiny-test model) from one global, data and seed, the loss after --steps steps of
each mode (bench/inside_site/losses.py), so a user sees what a mode costs in quality.

    python bench/inside_site/run.py                      # Leonardo, 128 nodes, Llama-3.1-8B
    python bench/inside_site/run.py --nodes 16 --tokens 2048 --reduce-bytes 2 --no-loss
    python bench/inside_site/run.py --facility karolina --steps 60 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import cost  # noqa: E402 (this folder, not a package)

# Published nominal figures, one direction, unverified here: a GPU's intra-node link (GB/s),
# a node's inter-node network (GB/s, all its NICs), a GPU's dense bf16 peak (TFLOP/s).
NOMINAL = {
    "leonardo": {"intra": 200, "inter": 50, "peak": 312},  # NVLink 3, 4x HDR100, A100
    "karolina": {"intra": 300, "inter": 100, "peak": 312},  # NVLink 3, 4x HDR200, A100
    "lumi": {"intra": 50, "inter": 100, "peak": 191.5},  # Infinity Fabric, 4x Slingshot 200,
    #                                                       one MI250X GCD
}


def facility_gpus(name: str) -> int:
    """GPUs per node of the bundled profile ``name`` (its slurm.gpus_per_node)."""
    profile = yaml.safe_load((REPO / "site_profiles" / "bundled" / f"{name}.yaml").read_text())
    return int(profile["slurm"]["gpus_per_node"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line (every cost-model input has a flag; facility values are defaults)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--facility", choices=sorted(NOMINAL), default="leonardo")
    p.add_argument("--params", type=float, default=cost.Model.params)
    p.add_argument("--layers", type=int, default=cost.Model.layers)
    p.add_argument("--hidden", type=int, default=4096,
                   help="the model's width (reported; the FLOP count is 6 N per token)")
    p.add_argument("--nodes", type=int, default=cost.Machine.nodes)
    p.add_argument("--gpus-per-node", type=int, help="default: the facility's profile")
    p.add_argument("--intra-gbs", type=float, help="GB/s per GPU inside a node")
    p.add_argument("--inter-gbs", type=float, help="GB/s per node across nodes")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU")
    p.add_argument("--mfu", type=float, default=cost.Work.mfu)
    p.add_argument("--tokens", type=int, default=cost.Work.tokens, help="per GPU per step")
    p.add_argument("--reduce-bytes", type=int, default=cost.Work.reduce_bytes,
                   help="bytes a parameter in gradient reductions (xffl: fp32, 4)")
    p.add_argument("--group-nodes", type=int, default=1,
                   help="nodes of an HSDP shard group and of a federated group")
    p.add_argument("--every", default="1,8,64", help="the federated groups' K values")
    p.add_argument("--steps", type=int, default=128,
                   help="optimizer steps of the loss table (128: K=64 averages twice)")
    p.add_argument("--no-loss", action="store_true", help="the step table only")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def inputs(args: argparse.Namespace) -> tuple[cost.Model, cost.Machine, cost.Work]:
    """The cost model's inputs: the flags, else the facility's values."""
    nominal = NOMINAL[args.facility]
    machine = cost.Machine(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node or facility_gpus(args.facility),
        intra=(args.intra_gbs or nominal["intra"]) * cost.GB,
        inter=(args.inter_gbs or nominal["inter"]) * cost.GB,
        peak=(args.peak_tflops or nominal["peak"]) * 1e12)
    return (cost.Model(params=args.params, layers=args.layers), machine,
            cost.Work(tokens=args.tokens, mfu=args.mfu, reduce_bytes=args.reduce_bytes))


def step_rows(steps: list[cost.Step]) -> list[dict[str, Any]]:
    """The step table's rows, each with its ratio to the first (FSDP2, the baseline)."""
    base = steps[0].time
    return [{"mode": s.mode, "compute_s": s.compute, "comm_s": s.comm, "average_s": s.average,
             "step_s": s.time, "vs_fsdp": s.time / base, "states_gib": s.states_gib}
            for s in steps]


def print_steps(rows: list[dict[str, Any]], model: cost.Model, machine: cost.Machine,
                work: cost.Work, hidden: int) -> None:
    """The step table, with the inputs it was computed from."""
    print(f"step time (a cost model, not a measurement): {model.params / 1e9:.2f} B "
          f"parameters, {model.layers} layers, hidden {hidden}; {machine.nodes} nodes x "
          f"{machine.gpus_per_node} GPUs; intra {machine.intra / cost.GB:g} GB/s/GPU, inter "
          f"{machine.inter / cost.GB:g} GB/s/node; {machine.peak / 1e12:g} TFLOP/s x MFU "
          f"{work.mfu:g}; {work.tokens} tokens/GPU/step; gathers {work.gather_bytes} B, "
          f"reductions {work.reduce_bytes} B a parameter")
    print(f"{'mode':<28}{'compute s':>10}{'comm s':>9}{'avg s':>8}{'step s':>9}"
          f"{'vs fsdp':>9}{'states GiB':>12}")
    for r in rows:
        print(f"{r['mode']:<28}{r['compute_s']:>10.3f}{r['comm_s']:>9.3f}{r['average_s']:>8.3f}"
              f"{r['step_s']:>9.3f}{r['vs_fsdp']:>9.2f}{r['states_gib']:>12.2f}")


def print_losses(table: dict[str, dict[str, float]], steps: int) -> None:
    """The loss table, each mode against the first (FSDP2)."""
    base = next(iter(table.values()))
    print(f"\nloss after {steps} steps (measured: site rounds on CPU, gloo, 4 ranks, "
          "tiny-test; held-out: the site's validation share)")
    print(f"{'mode':<28}{'train loss':>11}{'held-out':>10}{'vs fsdp':>10}{'wall s':>8}")
    for name, r in table.items():
        print(f"{name:<28}{r['loss_last']:>11.4f}{r['val_loss']:>10.4f}"
              f"{r['val_loss'] - base['val_loss']:>+10.1e}{r['seconds']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    """Print the step table and (unless --no-loss) the loss table."""
    args = parse(argv)
    model, machine, work = inputs(args)
    every = tuple(int(k) for k in args.every.split(","))
    rows = step_rows(cost.step_table(model, machine, work, args.group_nodes, every))
    result: dict[str, Any] = {"inputs": {**asdict(model), **asdict(machine), **asdict(work)},
                              "steps": rows}
    if not args.json:
        print_steps(rows, model, machine, work, args.hidden)
    if not args.no_loss:
        import losses

        with tempfile.TemporaryDirectory(prefix="xffl-inside-site-") as work_dir:
            table = losses.loss_table(Path(work_dir), args.steps)
        result["losses"] = table
        if not args.json:
            print_losses(table, args.steps)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
