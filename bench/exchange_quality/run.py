"""Benchmark: what fewer bytes per round cost in quality, on quickstart-sized runs.

Each configuration is the quickstart's job (tiny LLaMA-architecture model, 2 sites with
their own synthetic language, 30 local AdamW steps of 8 x 64 tokens, FedProx 0.1) run for
``--rounds`` rounds by ``xffl simulate`` (real training: the trainer real sites run, one
process per virtual site, and the coordinator's admission and streaming aggregation). The
final global is then evaluated on each virtual site's held-out text: the next 128 sequences
of its dialect after the ones it trained on (the generator's stream is prefix-stable), never
seen in training; the federated validation loss is their mean. Rows:

- fp32 weights, bf16 delta, int8 delta, nf4 delta with and without error feedback (fedavg);
- fedavg and diloco (outer lr 0.7, Nesterov momentum 0.9) at 4x the local steps, fp32.

Every row runs once per ``--seeds`` value (``training.seed``: the model's init and the data
order), because one quantized run differs from the fp32 one by more than its rounding:
training amplifies any change of trajectory. Printed per row: the mean final federated
validation loss over the seeds and its range, the bytes one site sends per round
(the files of its round-1 update: tensors, header, manifest, config) and their ratio to fp32
weights' (the baseline, measured in the same invocation), and the wall time.

    python bench/exchange_quality/run.py                 # every row, 10 rounds
    python bench/exchange_quality/run.py --rounds 3 --only "fp32 weights" --json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
DELTA = {"update": "delta"}
ROWS: dict[str, dict[str, Any]] = {
    "fp32 weights": {},
    "bf16 delta": {"exchange": {**DELTA, "dtype": "bf16"}},
    "int8 delta": {"exchange": {**DELTA, "dtype": "int8"}},
    "nf4 delta + error feedback": {"exchange": {**DELTA, "dtype": "nf4"}},
    "nf4 delta, no error feedback": {"exchange": {**DELTA, "dtype": "nf4",
                                                  "error_feedback": False}},
    "fedavg, 4x local steps": {"training": {"steps": 120}},
    "diloco, 4x local steps": {"training": {"steps": 120},
                               "aggregation": {"strategy": "diloco"}},
}


SITES = {"alpha-0": ("alpha", 768), "beta-1": ("beta", 512)}  # the quickstart's corpora
HELD_OUT = 128  # sequences
SEQ_LEN = 64


def held_out_loss(model: Path, site: str, work: Path) -> float:
    """Mean next-token loss of ``model`` on the HELD_OUT sequences of ``site``'s dialect that
    follow the ones it trained on."""
    from xffl.training.trainer import evaluate
    from xffl.workflows.simulate_sites import ensure_dialect, ensure_partition

    base, trained = SITES[site]
    whole, tail = work / "held-out" / site / "whole", work / "held-out" / site / "tail"
    ensure_dialect(whole, base, site, trained + HELD_OUT, SEQ_LEN)
    parts = (trained + HELD_OUT) // HELD_OUT  # 768 and 512 are multiples of 128
    ensure_partition(whole, tail, parts - 1, parts, SEQ_LEN)
    return evaluate(model, tail, SEQ_LEN, HELD_OUT // 8, batch_size=8)


def job_for(changes: dict[str, Any], name: str, seed: int = 0) -> dict[str, Any]:
    """The quickstart's job with ``changes`` merged into its sections, and ``seed``."""
    spec: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())
    spec["name"] = name
    spec["training"]["seed"] = seed
    for section, values in changes.items():
        merged = copy.deepcopy(spec.get(section) or {})
        merged.update(values)
        spec[section] = merged
    return spec


def run_row(label: str, rounds: int, work: Path, seed: int = 0) -> dict[str, Any]:
    """Simulate one row's job for ``rounds`` rounds; its numbers."""
    slug = "".join(c if c.isalnum() else "-" for c in label).strip("-") + f"-s{seed}"
    job = work / f"{slug}.yaml"
    job.write_text(yaml.safe_dump(job_for(ROWS[label], f"q{list(ROWS).index(label)}-s{seed}",
                                          seed)))
    out = work / slug
    env = {**os.environ, "XFFL_HOME": str(work / "home")}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("xffl")), "simulate", str(job), "--sites", "2",
         "--rounds", str(rounds), "--out", str(out), "--keep-updates", "--json"],
        env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label}: xffl simulate failed ({proc.returncode}):\n{proc.stderr}")
    final = out / "rounds" / str(rounds) / "global"
    losses = [held_out_loss(final, site, work) for site in SITES]
    from xffl.training.data import load_tokens

    for i, site in enumerate(SITES):  # the held-out text continues what the site trained on
        trained = load_tokens(out / "data" / f"site-{i}")
        whole = load_tokens(work / "held-out" / site / "whole")
        if not (trained == whole[: trained.size]).all():
            raise SystemExit(f"{site}: the held-out text does not continue the site's data")
    sent = []
    for site in sorted((out / "rounds" / "1" / "updates").iterdir()):
        sent.append(sum(p.stat().st_size for p in site.iterdir() if p.is_file()))
    return {"row": label, "seed": seed, "final_val_loss": sum(losses) / len(losses),
            "val_loss_by_site": dict(zip(SITES, losses, strict=True)),
            "bytes_per_site_round": sum(sent) / len(sent), "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    """Run the rows; print a table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", action="append", choices=list(ROWS), default=None)
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = args.only or list(ROWS)
    if "fp32 weights" not in rows:
        rows.insert(0, "fp32 weights")  # the baseline of the byte ratios
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="xffl-exchange-quality-") as tmp:
        runs = [run_row(label, args.rounds, Path(tmp), seed) for label in rows
                for seed in seeds]
    base = runs[0]["bytes_per_site_round"]
    table = []
    for label in rows:
        mine = [r for r in runs if r["row"] == label]
        losses = [r["final_val_loss"] for r in mine]
        table.append({"row": label, "mean_val_loss": statistics.fmean(losses),
                      "min_val_loss": min(losses), "max_val_loss": max(losses),
                      "bytes_per_site_round": mine[0]["bytes_per_site_round"],
                      "vs_fp32_bytes": mine[0]["bytes_per_site_round"] / base,
                      "wall_s": statistics.fmean(r["wall_s"] for r in mine)})
    if args.json:
        print(json.dumps({"rounds": args.rounds, "seeds": seeds, "rows": table, "runs": runs},
                         indent=2))
        return 0
    print(f"{args.rounds} rounds, seeds {seeds}")
    print(f"{'row':30} {'val loss (mean)':>15} {'range':>15} {'bytes/site/round':>17} "
          f"{'vs fp32':>8} {'wall s':>7}")
    for r in table:
        span = f"{r['min_val_loss']:.3f}-{r['max_val_loss']:.3f}"
        print(f"{r['row']:30} {r['mean_val_loss']:15.4f} {span:>15} "
              f"{r['bytes_per_site_round']:17,.0f} {r['vs_fp32_bytes']:8.3f} {r['wall_s']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
