"""A site that sends a finite delta which overflows once added to the global is rejected at
admission: the round goes on without it, and no inf reaches a global model."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import read_manifest
from xffl.core.layout import RunLayout
from xffl.jobs.states import SiteState
from xffl.training.config import ExchangeSpec
from xffl.workflows.steps.admit import admit

CONFIG = {"hidden_size": 8}


def test_an_overflowing_delta_is_rejected(tmp_path: Path) -> None:
    big = 3.0e38  # finite in fp32 and in bf16; twice it is not (fp32 max is 3.4e38)
    parent = write_checkpoint(tmp_path / "global",
                              {"w": torch.tensor([1.0, big]), "b": torch.zeros(3)},
                              kind="global", site=None, round=0, config=CONFIG)
    digest = read_manifest(parent).digest()
    exchange = ExchangeSpec.parse("delta/bf16")

    def update(site: str, w: list[float]) -> Path:
        return write_checkpoint(tmp_path / site, {
            "w": torch.tensor(w, dtype=torch.bfloat16),
            "b": torch.zeros(3, dtype=torch.bfloat16)},
            site=site, round=1, parent=digest, num_samples=4, run_id="run-1", config=CONFIG)

    layout = RunLayout(tmp_path / "run")
    honest, _ = admit(layout, "honest", 1, parent, update("honest", [0.5, -1.0e36]),
                      exchange=exchange)
    assert honest.state == SiteState.COMPLETED, honest.reason
    hostile, manifest = admit(layout, "hostile", 1, parent, update("hostile", [0.0, big]),
                              exchange=exchange)
    assert (hostile.state, manifest) == (SiteState.REJECTED, None)
    assert hostile.reason == "its delta of tensor 'w' added to the global model overflows " \
        "its dtype"
    # the same update read as bf16 weights is not a delta: nothing is added, nothing overflows
    plain, _ = admit(layout, "hostile", 1, parent, tmp_path / "hostile",
                     exchange=ExchangeSpec.parse("weights/bf16"))
    assert plain.state == SiteState.COMPLETED, plain.reason
