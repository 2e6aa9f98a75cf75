"""A LoRA round from a bf16 frozen base (as `xffl render`/`submit` now write it from a bf16
``model.init``) trains what the fp32-widened base trained."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file

from xffl.aggregator.exchange import Manifest
from xffl.aggregator.shards import ADAPTER_FILE
from xffl.training import lora
from xffl.training.checkpoint import init_global, read_weights
from xffl.training.config import LoraSpec, ModelSpec, TrainJob
from xffl.training.data import ensure_synthetic
from xffl.training.trainer import train_round

SPEC = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def test_a_bf16_base_trains_the_adapter_the_widened_base_trains(
        tmp_path: Path, global0: tuple[Path, Manifest],
        make_job: Callable[..., TrainJob]) -> None:
    """On a CPU the frozen base computes in fp32 (lora.frozen_dtype), and widening bf16 to
    fp32 is exact: the base kept in bf16 and the one widened to fp32 at round 0 are the same
    fp32 weights at the site, so the same adapter comes back, bit for bit."""
    g0, _ = global0
    ckpt = tmp_path / "bf16"
    ckpt.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in read_weights(g0).items()},
              str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    (ckpt / "config.json").write_bytes((g0 / "config.json").read_bytes())
    model = ModelSpec(init=str(ckpt))
    job = make_job(tmp_path / "data", steps=3, lr=1e-2, sequences=32)
    job = job.model_copy(update={"model": model, "training": job.training.model_copy(
        update={"lora": SPEC})})
    ensure_synthetic(Path(job.data.path), "alpha", 32, job.training.seq_len)
    adapters = {}
    for keep in (True, False):
        base = tmp_path / f"base-{keep}"
        init_global("run-test", model, 0, base, keep_dtype=keep)
        dtypes = {str(v.dtype) for v in read_weights(base).values()}
        assert dtypes == {"torch.bfloat16" if keep else "torch.float32"}
        adapter0 = tmp_path / f"adapter0-{keep}"
        lora.init_adapter_global("run-test", model, SPEC, 0, adapter0, str(base))
        out = tmp_path / f"update-{keep}"
        train_round(job, 1, adapter0, Path(job.data.path), out, base_dir=base)
        adapters[keep] = load_file(str(out / ADAPTER_FILE))
    assert adapters[True].keys() == adapters[False].keys() and adapters[True]
    for name, value in adapters[True].items():
        assert np.array_equal(value, adapters[False][name]), name
