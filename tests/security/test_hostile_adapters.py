"""A LoRA job's sites are checked like any other, and more: under ``aggregation.lora:
freeze_a`` a site that moves an A factor (and so the product B·A every site relies on) is
rejected, and so is a whole model sent where an adapter is expected, or an adapter with
another rank or scaling than the global's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from xffl.aggregator.exchange import Manifest, finalize_manifest, read_manifest
from xffl.aggregator.shards import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.training import lora
from xffl.training.checkpoint import init_global
from xffl.training.config import LoraSpec, ModelSpec
from xffl.workflows.steps.admit import admit

SPEC = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


Tensors = dict[str, np.ndarray]


def _update(tmp_path: Path, parent: Path, site: str,
            change: Callable[[Tensors], None] | None = None,
            config: dict[str, Any] | None = None) -> Path:
    """The global adapter sent back by ``site``, after ``change(tensors)``."""
    tensors = load_file(str(parent / ADAPTER_FILE))
    for name in [n for n in tensors if n.endswith(".lora_B.weight")]:
        tensors[name] = tensors[name] + 0.01  # what training does to B
    if change is not None:
        change(tensors)
    out = tmp_path / site
    out.mkdir()
    save_file(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    text = (parent / ADAPTER_CONFIG_FILE).read_text()
    if config is not None:
        text = json.dumps({**json.loads(text), **config})
    (out / ADAPTER_CONFIG_FILE).write_text(text)
    parent_manifest = read_manifest(parent)
    finalize_manifest(out, Manifest(kind="update", run_id=parent_manifest.run_id, round=1,
                                    site=site, num_samples=8, parent=parent_manifest.digest()))
    return out


def test_adapter_updates_are_checked(tmp_path: Path) -> None:
    glob = tmp_path / "global"
    lora.init_adapter_global("run-1", ModelSpec(preset="tiny-test"), SPEC, 0, glob, "base")
    layout = RunLayout(tmp_path / "run")

    def judge(update: Path, freeze_a: bool = True) -> tuple[SiteState, str]:
        verdict, _ = admit(layout, update.name, 1, glob, update, freeze_a=freeze_a)
        return verdict.state, verdict.reason

    assert judge(_update(tmp_path, glob, "honest")) == (SiteState.COMPLETED, "")

    def nudge_a(tensors: Tensors) -> None:
        name = sorted(n for n in tensors if n.endswith(".lora_A.weight"))[1]
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = tensors[name][0, 0] * (1 + 2**-20)  # one element, a few ulps
    moved = _update(tmp_path, glob, "moves-a", nudge_a)
    state, reason = judge(moved)
    assert state == SiteState.REJECTED
    assert reason.startswith("it changed 'base_model.model.model.layers.") and \
        reason.endswith(".lora_A.weight', which aggregation.lora: freeze_a keeps at the "
                        "global's value")
    assert judge(moved, freeze_a=False)[0] == SiteState.COMPLETED  # separate: A trains

    assert judge(_update(tmp_path, glob, "rank-8", config={"r": 8})) == (
        SiteState.REJECTED, f"{ADAPTER_CONFIG_FILE} differs from the global model's")

    whole = tmp_path / "whole-model"  # a full model where the job exchanges adapters
    init_global("run-1", ModelSpec(preset="tiny-test"), 0, tmp_path / "m")
    shutil.copytree(tmp_path / "m", whole)
    m = read_manifest(whole)
    (whole / "manifest.json").unlink()
    finalize_manifest(whole, m.model_copy(update={
        "kind": "update", "site": "whole-model", "round": 1,
        "parent": read_manifest(glob).digest(), "num_samples": 8}))
    assert judge(whole) == (SiteState.REJECTED,
                            f"a LoRA adapter is expected ({ADAPTER_FILE}, not a whole model)")


def _encoded(tmp_path: Path, parent: Path, site: str, dtype: str,
             change: Callable[[Tensors], None] | None = None) -> Path:
    """``site``'s honest adapter update sent as ``dtype`` weights (as training.encode does:
    fp32 rounded to nearest even); ``change`` then alters the encoded tensors."""
    import torch
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    out = _update(tmp_path, parent, site)
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tensors = {k: v.to(target) for k, v in load_torch(str(out / ADAPTER_FILE)).items()}
    if change is not None:
        change(tensors)  # type: ignore[arg-type]
    save_torch(tensors, str(out / ADAPTER_FILE), metadata={"format": "pt"})
    old = read_manifest(out)
    (out / "manifest.json").unlink()
    finalize_manifest(out, old)
    return out


def test_freeze_a_admits_honest_updates_in_a_narrower_exchange(tmp_path: Path) -> None:
    """Under a bf16 or fp16 exchange an honest site's A is the global's A rounded to that
    dtype: admitted, and the round's FedAvg goes through; moving one A element by one ulp
    of the exchange's dtype is still a rejection."""
    import torch

    from xffl.aggregator.decode import Decoding
    from xffl.aggregator.engine import run_strategy
    from xffl.aggregator.exchange_spec import ExchangeSpec

    glob = tmp_path / "global"
    lora.init_adapter_global("run-1", ModelSpec(preset="tiny-test"), SPEC, 0, glob, "base")
    layout = RunLayout(tmp_path / "run")
    for dtype in ("bf16", "fp16"):
        (tmp_path / dtype).mkdir()
        exchange = ExchangeSpec.parse(f"weights/{dtype}")
        honest = [_encoded(tmp_path / dtype, glob, s, dtype) for s in ("alpha", "beta")]
        for update in honest:
            verdict, _ = admit(layout, update.name, 1, glob, update, exchange=exchange,
                               freeze_a=True)
            assert verdict.state == SiteState.COMPLETED, (dtype, verdict.reason)

        def nudge(tensors: dict[str, torch.Tensor]) -> None:
            name = sorted(n for n in tensors if n.endswith(".lora_A.weight"))[0]
            bits = tensors[name].view(torch.int16)
            bits[0, 0] += 1  # the next value of the exchange's dtype
        moved = _encoded(tmp_path / dtype, glob, "moves-a", dtype, nudge)
        verdict, _ = admit(layout, "moves-a", 1, glob, moved, exchange=exchange, freeze_a=True)
        assert verdict.state == SiteState.REJECTED and "lora_A.weight" in verdict.reason
        out = tmp_path / dtype / "global-1"
        run_strategy("fedavg", honest, glob, out, run_id="run-1", round=1,
                     parent_digest=read_manifest(glob).digest(),
                     decoding=Decoding(glob, delta=False))
        assert (out / ADAPTER_CONFIG_FILE).read_bytes() == \
            (glob / ADAPTER_CONFIG_FILE).read_bytes()
