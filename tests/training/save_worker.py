"""Workers for the streamed update save's tests (tests/training/test_update_save.py).

``python -m xffl.training.forked --nproc-per-node 2 -m tests.training.save_worker OUT``: one
launch of two gloo ranks runs every case in turn, each into a folder of its own:

- ``OUT/memory``: FSDP2 at dp 2 over a model at Llama-3.1-8B width, saved streamed (first,
  on a fresh heap); rank 0 writes ``memory.json``: its RSS before the save, its peak during
  it (VmHWM, reset just before) and the largest tensor's bytes.
- ``OUT/fsdp``: (FSDP2 at dp 2, or tp 2) for each case and exchange, rank 0 writes the update
  once as the site wrote it before streaming (``full_state_dict``, ``encode_update``,
  safetensors' ``save_file``) into ``<case>/<exchange>/old`` and once streamed into ``new``.
- ``OUT/evaluate`` (its ``global`` and ``data`` made by the test): ``xffl evaluate``'s load
  and losses, one ``rank<r>.json`` per rank.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.training.warm import warm_presets
from xffl.aggregator.exchange import Manifest
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.training.arch import ModelConfig, build_config
from xffl.training.checkpoint import init_global, save_checkpoint
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.encode import encode_update
from xffl.training.evaluate_models import eval_model, evaluate_models
from xffl.training.model import build_model
from xffl.training.parallelize import ParallelModel, is_dtensor, parallelize
from xffl.training.update_save import PIECE, drain, gather_tensors, save_update

EXCHANGES = ("weights/fp32", "delta/bf16", "delta/int8")
#: FSDP2 at dp 2 with an odd vocabulary (uneven shards: 129 and 128 rows), tied embeddings
#: and biases (tiny-qwen2), and tp 2 (column- and row-wise shards, FSDP2 over a dp of 1).
FSDP_CASES: dict[str, tuple[str, dict[str, int | float | bool], int]] = {
    "dp2-odd-vocab": ("tiny-test", {"vocab_size": 257}, 1),
    "dp2-tied": ("tiny-qwen2", {}, 1),
    "tp2": ("tiny-test", {}, 2),
}
#: Llama-3.1-8B's widths, one decoder layer, tied head: the 128256 x 4096 fp32 embedding
#: (2 GiB) is the largest tensor (untied, the head doubles the model and not the bound).
WIDE = {"num_hidden_layers": 1, "tie_word_embeddings": True, "max_position_embeddings": 2048}


def manifest(round: int = 1) -> Manifest:
    """The update manifest both ways of saving are given."""
    return Manifest(kind="update", run_id="save-test", round=round, site="a", num_samples=4,
                    num_tokens=64, metrics={"loss": 1.0}, parent="p" * 64)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight a little, deterministically (a round's training, as far as the
    save can tell)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def save_old(pm: ParallelModel, config: ModelConfig, parent: Path, out: Path,
             exchange: ExchangeSpec, state_dir: Path | None, round: int = 1) -> None:
    """The update save as the site wrote it before streaming (collective; rank 0 writes)."""
    state = pm.full_state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_checkpoint(encode_update(state, parent, exchange, state_dir, round), config, out,
                        manifest(round))


def save_new(pm: ParallelModel, config: ModelConfig, parent: Path, out: Path,
             exchange: ExchangeSpec, state_dir: Path | None, round: int = 1,
             piece: int = PIECE) -> Manifest | None:
    """The streamed update save (collective; rank 0 writes and gets the manifest);
    ``piece``: elements encoded at a time."""
    shapes, gathered = gather_tensors(pm)
    if dist.is_initialized() and dist.get_rank() != 0:
        drain(gathered)
        return None
    return save_update(gathered, shapes, config.to_json(), out, manifest(round), exchange,
                       parent, state_dir, piece=piece)


def fsdp(out: Path) -> None:
    """Both saves of every case and exchange, on 2 gloo ranks."""
    for case, (preset, overrides, tp) in FSDP_CASES.items():
        spec = ModelSpec(preset=preset, overrides=overrides)
        config = build_config(spec)
        parent = out / case / "global"
        if dist.get_rank() == 0:
            init_global("save-test", spec, 3, parent)
        dist.barrier()
        model = build_model(config, seed=3)
        perturb(model, 5)  # the same full weights on every rank, then sharded
        pm = parallelize(model, tp, torch.device("cpu"), "fsdp")
        for exchange_spec in EXCHANGES:
            exchange = ExchangeSpec.parse(exchange_spec)
            where = out / case / exchange_spec.replace("/", "-")
            for which, save in (("old", save_old), ("new", save_new)):
                save(pm, config, parent, where / which, exchange, where / f"{which}-state")
            dist.barrier()
    dist.barrier()


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(out: Path, which: str) -> None:
    """Under FSDP2 at dp 2, save the wide model ``which`` way; rank 0 writes its RSS before
    the save and its peak during it to ``OUT/memory.json``. The model is sharded on the meta
    device and only then given memory (each rank holds its half, as the sharded loader
    leaves it)."""
    config = build_config(ModelSpec(preset="llama3.1-8b", overrides=WIDE))
    with torch.device("meta"):
        model = build_model(config)
    pm = parallelize(model, 1, torch.device("cpu"), "fsdp")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.01)  # every page touched: the shards are in the RSS
    shapes, _ = gather_tensors(pm)
    largest = max(math.prod(s) * 4 for s in shapes.values())
    exchange = ExchangeSpec()  # fp32 weights: no parent is read
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    (save_old if which == "old" else save_new)(pm, config, out, out / which, exchange, None)
    peak = _status("VmHWM")
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "memory.json").write_text(json.dumps(
            {"before": before, "peak": peak, "largest": largest,
             "tied": model.lm_head.weight is model.model.embed_tokens.weight}))
    dist.barrier()


def eval_job(data: Path) -> TrainJob:
    """A job whose site holds a quarter of its sequences out, to evaluate on."""
    return TrainJob(run_id="save-test", site="a", model=ModelSpec(preset="tiny-test"),
                    training=TrainingSpec(batch_size=2, seq_len=16),
                    data=DataSpec(path=str(data), validation={"fraction": 0.25}))


def evaluate(out: Path) -> None:
    """``xffl evaluate``'s ranks on ``OUT/global`` (2 gloo ranks): each rank records whether
    it holds the model in slices and its losses to ``OUT/rank<r>.json``."""
    job = eval_job(out / "data")
    config = build_config(job.model)
    pm = eval_model(job, out / "global", config, torch.device("cpu"))
    sliced = all(is_dtensor(p) and p.to_local().numel() < p.numel()
                 for p in pm.module.parameters() if p.shape[0] > 1)
    _, _, losses = evaluate_models(job, {"global": out / "global"}, out / "data",
                                dist.get_rank() == 0)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"sliced": sliced, "losses": losses}))
    dist.barrier()


def warm_imports(argv: list[str]) -> None:
    """The cases' families' model code, imported once before the ranks fork."""
    warm_presets(["tiny-test", *(preset for preset, _, _ in FSDP_CASES.values())])


def main(out: Path) -> None:
    """Every case in one process group: the wide model's save first, on a fresh heap."""
    dist.init_process_group("gloo")
    (out / "memory").mkdir(parents=True, exist_ok=True)
    memory(out / "memory", "new")
    gc.collect()
    fsdp(out / "fsdp")
    evaluate(out / "evaluate")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
