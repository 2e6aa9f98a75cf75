"""`xffl render` of a LoRA job from a checkpoint: the frozen base keeps the checkpoint's dtype."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from xffl.aggregator.exchange import read_manifest
from xffl.cli.app import app
from xffl.core.layout import RunLayout
from xffl.jobs.spec.load import load_job
from xffl.training.checkpoint import init_global, read_weights
from xffl.training.config import ModelSpec
from xffl.workflows.plan.compile import write_initial_model

runner = CliRunner()


def _checkpoint(tmp_path: Path, dtype: torch.dtype) -> Path:
    """A Hugging Face checkpoint folder of the tiny-test model, its weights in ``dtype``."""
    seeded = tmp_path / "seeded"
    init_global("seed", ModelSpec(preset="tiny-test"), 3, seeded)
    out = tmp_path / f"ckpt-{dtype}".replace("torch.", "")
    out.mkdir()
    save_file({k: v.to(dtype) for k, v in read_weights(seeded).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_bytes((seeded / "config.json").read_bytes())
    return out


def _job(tmp_path: Path, init: Path, lora: bool) -> Path:
    spec = {"name": "base", "rounds": 1, "model": {"init": str(init)},
            "sites": [{"name": "alpha", "profile": "local", "ranks": 1,
                       "data": {"path": str(tmp_path / "data")}}]}
    if lora:
        spec["training"] = {"lora": {"r": 4}}
    path = tmp_path / f"job-{init.name}-{lora}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _tensors(folder: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor of a checkpoint folder: its dtype and its bytes."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                out[name] = (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_render_keeps_the_checkpoints_dtype_for_a_lora_jobs_frozen_base(
        tmp_path: Path, dtype: torch.dtype) -> None:
    """bf16 in, the same bf16 bytes out (it was widened to fp32: twice the bytes); fp32 stays
    fp32. The adapter the round trains is fp32 either way."""
    ckpt = _checkpoint(tmp_path, dtype)
    out = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(_job(tmp_path, ckpt, lora=True)), "-o",
                                 str(out)])
    assert result.exit_code == 0, result.output
    base = RunLayout(out).base_model
    assert _tensors(base) == _tensors(ckpt)
    assert {d for d, _ in _tensors(RunLayout(out).initial_model).values()} == {"torch.float32"}
    assert read_manifest(base).files  # a checkpoint the sites verify


def test_a_whole_model_job_still_starts_from_fp32(tmp_path: Path) -> None:
    """Trained weights need fp32 masters: a bf16 init is widened (exactly) for a full job."""
    ckpt = _checkpoint(tmp_path, torch.bfloat16)
    out = tmp_path / "plan"
    result = runner.invoke(app, ["render", str(_job(tmp_path, ckpt, lora=False)), "-o",
                                 str(out)])
    assert result.exit_code == 0, result.output
    got = _tensors(RunLayout(out).initial_model)
    assert {d for d, _ in got.values()} == {"torch.float32"}


def _recorder(calls: list[tuple[int, int]]) -> Callable[[int, int], None]:
    """A progress callback that records its calls."""
    return lambda done, total: calls.append((done, total))


def test_writing_round_0_reports_its_progress_to_the_end(tmp_path: Path) -> None:
    """What render's progress bar shows: (elements written, elements in all), rising to the
    model's element count, for a LoRA job's base and for a whole model's round 0."""
    ckpt = _checkpoint(tmp_path, torch.bfloat16)
    numel = sum(v.numel() for v in read_weights(ckpt).values())
    for lora in (True, False):
        calls: list[tuple[int, int]] = []
        job = load_job(_job(tmp_path, ckpt, lora=lora))
        layout = RunLayout(tmp_path / f"run-{lora}")
        write_initial_model(layout, job.spec, "run", progress=_recorder(calls))
        assert calls and calls[-1] == (numel, numel)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
