"""The trainer in one process: update checkpoints, chained rounds, evaluation, failures."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from xffl.aggregator.exchange import Manifest, read_manifest, verify_checkpoint
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.training.__main__ import main as trainer_main
from xffl.training.checkpoint import init_global, read_config
from xffl.training.config import ModelSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.trainer import evaluate, train_round

JobFactory = Callable[..., TrainJob]


def _prepare(job: TrainJob) -> Path:
    data = Path(job.data.path)
    assert job.data.synthetic is not None
    ensure_synthetic(data, job.data.synthetic, job.data.synthetic_sequences, job.training.seq_len)
    return data


def test_init_global_writes_a_verified_hf_checkpoint(global0: tuple[Path, Manifest]) -> None:
    path, manifest = global0
    assert verify_checkpoint(path) == manifest
    assert (manifest.kind, manifest.round, manifest.parent) == ("global", 0, None)
    assert {t.name for t in manifest.tensors} >= {"lm_head.weight", "model.norm.weight"}
    assert all(t.dtype == "F32" for t in manifest.tensors)
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        assert fh.metadata() == {"format": "pt"}  # transformers refuses files without it
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    # Same seed, same bytes; ModelSpec.init copies an existing checkpoint.
    again = init_global("run-test", ModelSpec(preset="tiny-test"), 0, path.parent / "again")
    assert again.files["model.safetensors"] == manifest.files["model.safetensors"]
    copied = init_global("run-test", ModelSpec(init=str(path)), 99, path.parent / "copied")
    assert copied.files["model.safetensors"] == manifest.files["model.safetensors"]


def test_train_round_writes_update(tmp_path: Path, global0: tuple[Path, Manifest],
                                   make_job: JobFactory) -> None:
    g0, g0_manifest = global0
    job = make_job(tmp_path / "data", sequences=30, steps=3)
    data = _prepare(job)
    out = tmp_path / "update"
    manifest = train_round(job, 1, g0, data, out)
    assert verify_checkpoint(out) == manifest == read_manifest(out)
    assert (manifest.kind, manifest.round, manifest.site, manifest.run_id) == (
        "update", 1, "site-a", "run-test")
    assert manifest.parent == g0_manifest.digest()
    assert manifest.num_samples == 30
    assert manifest.num_tokens == 3 * 2 * 16
    losses = manifest.extra["losses"]
    # float64 means of the same 3 positive losses in two summation orders: each sum errs by
    # <= 2 * 2^-53 of itself and each division by 2^-53, so the means differ by
    # <= (2 * 2 + 2) * 2^-53 = 6.7e-16 relative: rel 2e-15 (a loss dropped or a wrong
    # divisor is off by > 1e-3)
    assert manifest.metrics["loss"] == pytest.approx(sum(losses) / 3, rel=2e-15, abs=0)
    assert manifest.metrics["loss_first"] == losses[0]
    assert manifest.metrics["loss_last"] == losses[-1]
    assert manifest.metrics["tokens_per_s"] > 0 and manifest.metrics["train_seconds"] > 0
    assert read_config(out) == read_config(g0)
    before, after = load_file(g0 / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every tensor trained


def test_rounds_lower_the_evaluation_loss(tmp_path: Path, global0: tuple[Path, Manifest],
                                          make_job: JobFactory) -> None:
    model_dir, _ = global0
    job = make_job(tmp_path / "data", sequences=64, steps=12, batch_size=4, seq_len=32)
    data = _prepare(job)
    initial = evaluate(model_dir, data, 32, max_batches=4)
    assert initial == evaluate(model_dir, data, 32, max_batches=4)  # deterministic
    # An untrained model predicts nearly uniformly: its loss is log 256 plus a deviation set
    # by the seeded init and the fixed data (+0.0043 here, the same on every CPU up to
    # rounding: per-batch fp32 losses err by < 2e-4, see test_loop's derivation): abs 0.02.
    # A broken evaluate (a sum over tokens, log base 2) is off by > 1, an init with 3x the
    # weights' scale by 0.055.
    assert initial == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.02)
    for rnd in (1, 2, 3):
        out = tmp_path / f"round{rnd}"
        manifest = train_round(job, rnd, model_dir, data, out)
        assert manifest.parent == read_manifest(model_dir).digest()
        model_dir = out
    final = evaluate(model_dir, data, 32, max_batches=4)
    assert final < initial - 1.0, (initial, final)


def test_tampered_global_is_rejected(tmp_path: Path, global0: tuple[Path, Manifest],
                                     make_job: JobFactory) -> None:
    g0, _ = global0
    job = make_job(tmp_path / "data", sequences=8)
    data = _prepare(job)
    blob = bytearray((g0 / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (g0 / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="checksum"):
        train_round(job, 1, g0, data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_seq_len_beyond_the_model_is_invalid(tmp_path: Path, global0: tuple[Path, Manifest],
                                             make_job: JobFactory) -> None:
    job = make_job(tmp_path / "data", sequences=4, seq_len=129)  # tiny-test: 128 positions
    data = _prepare(job)
    with pytest.raises(InvalidInput, match="max_position_embeddings"):
        train_round(job, 1, global0[0], data, tmp_path / "out")


def test_entry_point_in_process(tmp_path: Path, global0: tuple[Path, Manifest],
                                make_job: JobFactory, capsys: pytest.CaptureFixture[str]) -> None:
    job = make_job(tmp_path / "data", language="beta", sequences=10, steps=2)
    job_file = tmp_path / "job.json"
    job_file.write_text(job.model_dump_json())
    out = tmp_path / "out"
    args = ["--job", str(job_file), "--round", "2", "--model", str(global0[0]), "--out", str(out)]
    assert trainer_main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["digest"] == verify_checkpoint(out).digest()
    assert summary["round"] == 2 and summary["num_samples"] == 10
    assert (tmp_path / "data" / "meta.json").exists()  # generated on first use
    assert read_config(out) == read_config(global0[0])

    job_file.write_text(json.dumps({**json.loads(job.model_dump_json()), "site": None}))
    assert trainer_main(args) == 2
    assert "site" in capsys.readouterr().err


def test_same_seed_same_loss_curve(tmp_path: Path, global0: tuple[Path, Manifest],
                                   make_job: JobFactory) -> None:
    """Twice the same job: the same loss curve and the same bytes; another seed differs."""
    job = make_job(tmp_path / "data", sequences=40, steps=6, seed=11)
    data = _prepare(job)
    first = train_round(job, 1, global0[0], data, tmp_path / "a")
    second = train_round(job, 1, global0[0], data, tmp_path / "b")
    assert first.extra["losses"] == second.extra["losses"]
    assert first.files["model.safetensors"] == second.files["model.safetensors"]
    other = train_round(make_job(tmp_path / "data", sequences=40, steps=6, seed=12), 1,
                        global0[0], data, tmp_path / "c")
    assert other.extra["losses"] != first.extra["losses"]
