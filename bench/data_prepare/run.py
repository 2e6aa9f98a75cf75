"""Benchmark: `xffl data prepare` of a large JSON-lines instruction file, memory and speed.

Writes a JSON-lines file of synthetic instruction examples (Alpaca's fields, words of the
sft-lora starter's tiny chat tokenizer) of ``--size-mb`` MB in a temporary folder, then, each
in a process of its own that reports its peak resident memory (VmHWM) as it exits:

- ``xffl data prepare FILE --format instruction --tokenizer TOK -o OUT`` (streamed: the
  target is a peak RSS under 500 MB however large the file);
- the same file through ``datasets``: ``load_dataset("json")`` then ``Dataset.map`` (batched)
  rendering each example with ``apply_chat_template`` and tokenizing it with the same
  tokenizer, the usual way to tokenize such a file.

It prints the tokens/s of each (the tokens xffl stored, over each process's wall time) and
their ratio. Targets: xffl's peak RSS < 500 MB at 2 GB.

    python bench/data_prepare/run.py                 # 2048 MB: long on a small machine
    python bench/data_prepare/run.py --size-mb 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_RSS_MB = 500
# each process writes its own peak RSS (VmHWM, which starts afresh at exec) when it exits:
# wait4's ru_maxrss would also count the parent's pages at fork time, which for a parent
# that imported torch (a test) alone exceed the target
PEAK = """
import atexit, os
def _peak():
    with open("/proc/self/status") as fh:
        kb = next(line.split()[1] for line in fh if line.startswith("VmHWM:"))
    with open(os.environ["XFFL_BENCH_PEAK"], "w") as out:
        out.write(kb)
atexit.register(_peak)
"""
PREPARE = PEAK + "from xffl.cli.app import main; main()"
DATASETS_MAP = PEAK + """
import sys
import datasets
from transformers import AutoTokenizer
src, tok_dir, cache = sys.argv[1:4]
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tok_dir)
ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)

def encode(batch):
    texts = []
    for ins, inp, out in zip(batch["instruction"], batch["input"], batch["output"]):
        prompt = ins + ("\\n\\n" + inp if inp else "")
        texts.append(tok.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": out}],
            tokenize=False))
    return {"input_ids": tok(texts, add_special_tokens=False)["input_ids"]}

ds = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names)
import pyarrow.compute as pc  # counted on the memory-mapped table: nothing loaded
print(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py())
"""


def write_jsonl(path: Path, size_mb: float, seed: int = 0) -> int:
    """Instruction examples of about ``size_mb`` MB at ``path``; the number written."""
    from xffl.training.sft_demo import INSTRUCTIONS, WORDS

    rng = random.Random(seed)
    target, written, count = int(size_mb * (1 << 20)), 0, 0
    instructions = list(INSTRUCTIONS.values())
    with path.open("w") as fh:
        while written < target:
            lines = []
            for _ in range(1000):
                words = rng.choices(WORDS, k=rng.randint(8, 60))
                lines.append(json.dumps({"instruction": rng.choice(instructions),
                                         "input": " ".join(words[: len(words) // 2]),
                                         "output": " ".join(words[len(words) // 2:])}))
            block = "\n".join(lines) + "\n"
            fh.write(block)
            written += len(block)
            count += len(lines)
    return count


def measure(argv: list[str], peak: Path) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, stdout) of one process (its RSS written to ``peak``)."""
    began = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False,
                          env={**os.environ, "XFFL_BENCH_PEAK": str(peak)})
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed ({done.returncode}): "
                         f"{done.stderr[-800:]}")
    return seconds, int(peak.read_text()) / 1024, done.stdout  # VmHWM is in kB


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print its lines (or JSON); 0 when the RSS target is met."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=2048,
                        help="MB of JSON lines (a fraction for a smoke run)")
    parser.add_argument("--no-datasets", action="store_true",
                        help="leave out the datasets.map baseline")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from xffl.training.sft_demo import write_tokenizer

    with tempfile.TemporaryDirectory(prefix="xffl-bench-prepare-") as tmp:
        root = Path(tmp)
        src = root / "instructions.jsonl"
        examples = write_jsonl(src, args.size_mb)
        tok = write_tokenizer(root / "tokenizer")
        seconds, rss, out = measure([sys.executable, "-c", PREPARE, "data", "prepare",
                                     str(src), "--format", "instruction", "--tokenizer",
                                     str(tok), "-o", str(root / "out"), "--json"],
                                    root / "peak-xffl")
        tokens = json.loads(out)["num_tokens"]
        result = {"size_mb": round(src.stat().st_size / (1 << 20), 1), "examples": examples,
                  "tokens": tokens, "xffl": {"seconds": round(seconds, 2),
                                             "peak_rss_mb": round(rss, 1),
                                             "tokens_per_s": round(tokens / seconds)}}
        if not args.no_datasets:
            seconds, rss, out = measure([sys.executable, "-c", DATASETS_MAP, str(src),
                                         str(tok), str(root / "hf-cache")],
                                        root / "peak-datasets")
            result["datasets_map"] = {"seconds": round(seconds, 2),
                                      "peak_rss_mb": round(rss, 1),
                                      "tokens_per_s": round(tokens / seconds),
                                      "tokens": int(out.split()[-1])}
            result["ratio"] = round(result["xffl"]["tokens_per_s"]
                                    / result["datasets_map"]["tokens_per_s"], 3)
    ok = result["xffl"]["peak_rss_mb"] < TARGET_RSS_MB
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        x = result["xffl"]
        print(f"input: {result['size_mb']} MB, {examples} examples, {tokens} tokens")
        print(f"xffl data prepare: {x['seconds']} s, {x['tokens_per_s']} tokens/s, peak RSS "
              f"{x['peak_rss_mb']} MB (target < {TARGET_RSS_MB} MB: {'met' if ok else 'MISSED'})")
        if "datasets_map" in result:
            d = result["datasets_map"]
            print(f"datasets.map: {d['seconds']} s, {d['tokens_per_s']} tokens/s, peak RSS "
                  f"{d['peak_rss_mb']} MB")
            print(f"ratio xffl / datasets.map tokens/s: {result['ratio']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
