"""Benchmark: the bytes one site receives and sends per round, by what the round exchanges.

Computed from a model preset's shapes (no training), per site and round, one way:

- ``fp32 weights``: every parameter in float32 (what xffl exchanges today, both ways);
- ``bf16 delta``: every parameter's change from the parent global, in bfloat16;
- ``int8 delta`` / ``nf4 delta`` (block B): the change quantized blockwise
  (:mod:`xffl.aggregator.quantize`), tensor by tensor: one byte (int8) or half a byte (nf4,
  fp4) per element plus a float32 absmax per block of ``--block`` elements;
- ``LoRA r=R attention``: LoRA adapters (A: r x in, B: out x r, float32) on q, k, v and o;
- ``LoRA r=R all linear``: the same on q, k, v, o, gate, up and down.

Each is printed with its ratio to fp32 weights and to the bf16 full model (the baseline both
ratios use is computed in the same invocation). Tensor bytes only: the safetensors header,
manifest.json and config.json add a few KiB per checkpoint.

Measured: runs of the quickstart's job, once per exchange of ``--exchanges`` (default fp32
weights, bf16 deltas, then LoRA adapters of rank ``--rank`` on the attention projections and
on every linear layer, trained through peft on the frozen quickstart model; each submitted
into a temporary XFFL_HOME and waited for), or an existing run (``--run RUN``). The
registry has the bytes StreamFlow moved to and from each site in each round; they are
printed per site and round, with the median bytes sent back and its ratio to the first
run's (the baseline, measured in the same invocation).

    python bench/exchange_bytes/run.py                      # llama2-7b shapes + 2 quickstarts
    python bench/exchange_bytes/run.py --no-run --json      # computed only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of one decoder layer of a LLaMA config."""
    h, i, kv = config.hidden_size, config.intermediate_size, \
        config.num_key_value_heads * config.head_dim
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def lora_parameters(config: Any, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of LoRA rank ``rank`` on ``targets`` in every layer: r x (in + out)."""
    shapes = linear_shapes(config)
    return config.num_hidden_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def quantized_bytes(config: Any, dtype: str, block: int) -> int:
    """Bytes of a quantized delta of every parameter tensor, scales included."""
    from xffl.aggregator.codec import Codec
    from xffl.training.model import meta_model

    codec = Codec(dtype, block)
    return sum(codec.nbytes(p.numel()) for p in meta_model(config).parameters())


def computed(preset: str, rank: int, block: int = 128) -> dict[str, Any]:
    """Bytes per site per round, one way, of each exchange for the preset's shapes."""
    from xffl.training.arch import PRESETS
    from xffl.training.model import num_parameters

    config = PRESETS[preset]
    n = num_parameters(config)
    rows = {"fp32 weights": 4 * n, "bf16 delta": 2 * n,
            f"int8 delta (block {block})": quantized_bytes(config, "int8", block),
            f"nf4 delta (block {block})": quantized_bytes(config, "nf4", block),
            f"LoRA r={rank} attention": 4 * lora_parameters(config, rank, ATTENTION),
            f"LoRA r={rank} all linear": 4 * lora_parameters(config, rank, ALL_LINEAR)}
    fp32, bf16 = rows["fp32 weights"], 2 * n
    return {"preset": preset, "parameters": n, "rank": rank, "block": block,
            "bf16_full_bytes": bf16,
            "rows": [{"exchange": k, "bytes": v, "vs_fp32": v / fp32, "vs_bf16_full": v / bf16}
                     for k, v in rows.items()]}


def measured(run_id: str, home: Path | None = None) -> dict[str, Any]:
    """What the registry (XFFL_HOME's, or ``home``'s) recorded for ``run_id``: bytes in and
    out per site and round."""
    if home is not None:
        os.environ["XFFL_HOME"] = str(home)
    import yaml

    from xffl.jobs.registry.store import Registry
    from xffl.jobs.report.numbers import assemble
    from xffl.training.arch import PRESETS
    from xffl.training.model import num_parameters

    registry = Registry()
    run = registry.get_run(run_id)
    data = assemble(registry, run)
    spec = yaml.safe_load((Path(run.run_dir) / "job.yaml").read_text()) or {}
    exchange = spec.get("exchange") or {}
    lora = (spec.get("training") or {}).get("lora")
    rows = [{"round": r.round, "site": s.site, "received_bytes": s.received_bytes,
             "sent_bytes": s.sent_bytes} for r in data.rounds for s in r.sites]
    tiny = 4 * num_parameters(PRESETS["tiny"])
    sent = [r["sent_bytes"] for r in rows if r["sent_bytes"]]
    return {"run_id": run_id, "rows": rows, "tiny_fp32_tensor_bytes": tiny,
            "exchange": lora_label(lora) if lora else
            f"{exchange.get('update', 'weights')}/{exchange.get('dtype', 'fp32')}",
            "median_sent_bytes": statistics.median(sent) if sent else None,
            "sent_vs_tensors": statistics.median(sent) / tiny if sent else None}


def lora_label(lora: dict[str, Any]) -> str:
    """``LoRA r=16 attention``-style name of a job's training.lora."""
    targets = tuple(lora.get("target_modules") or ())
    which = {ATTENTION: "attention", ALL_LINEAR: "all linear"}.get(targets, "+".join(targets))
    return f"LoRA r={lora.get('r')} {which}"


def quickstart(home: Path, exchange: str, rank: int = 16) -> str:
    """Submit the quickstart with ``exchange`` (update/dtype, or lora:attention or lora:all)
    into ``home``; its run id."""
    import yaml

    env = {**os.environ, "XFFL_HOME": str(home)}
    spec = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    if exchange.startswith("lora:"):
        targets = ATTENTION if exchange == "lora:attention" else ALL_LINEAR
        spec["training"]["lora"] = {"r": rank, "alpha": 2 * rank,
                                    "target_modules": list(targets)}
    else:
        update, _, dtype = exchange.partition("/")
        spec["exchange"] = {"update": update, "dtype": dtype}
    job = home / "job.yaml"  # its data folders are made beside it
    job.parent.mkdir(parents=True, exist_ok=True)
    job.write_text(yaml.safe_dump(spec, sort_keys=False))
    xffl = str(Path(sys.executable).with_name("xffl"))
    done = subprocess.run([xffl, "submit", str(job), "--wait", "--json"], env=env, cwd=home,
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the quickstart failed ({done.returncode}): {done.stderr[-800:]}")
    return str(json.loads(done.stdout)["run_id"])


def render(result: dict[str, Any]) -> str:
    """The tables as text."""
    c = result["computed"]
    lines = [f"{c['preset']} ({c['parameters']:,} parameters), per site per round, one way:",
             f"{'exchange':<26}{'bytes':>16}{'vs fp32':>10}{'vs bf16 full':>14}"]
    for row in c["rows"]:
        lines.append(f"{row['exchange']:<26}{row['bytes']:>16,}{row['vs_fp32']:>10.4f}"
                     f"{row['vs_bf16_full']:>14.4%}")
    runs = result.get("measured") or []
    for m in runs:
        lines += ["", f"measured, run {m['run_id']} ({m['exchange']}; tiny preset: "
                  f"{m['tiny_fp32_tensor_bytes']:,} fp32 tensor bytes):",
                  f"{'round':<7}{'site':<10}{'received':>12}{'sent':>12}"]
        for row in m["rows"]:
            lines.append(f"{row['round']:<7}{row['site']:<10}{row['received_bytes'] or 0:>12,}"
                         f"{row['sent_bytes'] or 0:>12,}")
        if m["median_sent_bytes"] is not None:
            lines.append(f"median sent: {m['median_sent_bytes']:,.0f} bytes, "
                         f"{m['sent_vs_tensors']:.4f} x the fp32 tensor bytes")
    if len(runs) > 1 and runs[0]["median_sent_bytes"]:
        for m in runs[1:]:
            lines.append(f"median sent, {m['exchange']} / {runs[0]['exchange']}: "
                         f"{m['median_sent_bytes'] / runs[0]['median_sent_bytes']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the computed table and, unless --no-run, the measured one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--block", type=int, default=128, help="quantization block size")
    parser.add_argument("--run", help="an existing run (in XFFL_HOME) instead of new ones")
    parser.add_argument("--exchanges", default="weights/fp32,delta/bf16,lora:attention,lora:all",
                        help="the quickstart runs to measure, comma-separated update/dtype "
                        "or lora:attention / lora:all (rank --rank)")
    parser.add_argument("--no-run", action="store_true", help="computed numbers only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"computed": computed(args.preset, args.rank, args.block)}
    if args.run:
        result["measured"] = [measured(args.run)]
    elif not args.no_run:
        result["measured"] = []
        for i, exchange in enumerate(args.exchanges.split(",")):
            with tempfile.TemporaryDirectory(prefix=f"xffl-bytes-{i}-") as tmp:
                home = Path(tmp)
                result["measured"].append(measured(quickstart(home, exchange, args.rank), home))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
