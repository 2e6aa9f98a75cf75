"""A site that sends a finite delta which overflows once added to the global is rejected at
admission: the round goes on without it, and no inf reaches a global model."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import read_manifest
from xffl.core.layout import RunLayout
from xffl.jobs.registry.states import SiteState
from xffl.aggregator.exchange_spec import ExchangeSpec
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


def test_a_quantized_delta_that_does_not_fit_is_rejected_with_its_reason(
        tmp_path: Path) -> None:
    """An nf4 delta is admitted like every update; scales that are NaN, negative, or that
    overflow the global once decoded and added are rejected, each with its reason."""
    import numpy as np

    from xffl.aggregator.codec import scale_name
    from xffl.aggregator.quantize import quantize

    big = 3.0e38
    parent = write_checkpoint(tmp_path / "global",
                              {"w": torch.tensor([1.0, big, 0.0]), "b": torch.zeros(3)},
                              kind="global", site=None, round=0, config=CONFIG)
    digest = read_manifest(parent).digest()
    exchange = ExchangeSpec.parse("delta/nf4/16")
    assert exchange.codec is not None
    codec = exchange.codec

    def update(site: str, w_scale: float | None = None, shape_w: int = 2,
               sign: float = -1.0) -> Path:
        codes, scales = quantize(codec, np.array([0.5, sign, 0.25], dtype=np.float32))
        if w_scale is not None:
            scales[:] = w_scale
        b_codes, b_scales = quantize(codec, np.zeros(3, dtype=np.float32))
        return write_checkpoint(tmp_path / site, {
            "w": torch.from_numpy(codes[:shape_w].copy()),
            scale_name("w"): torch.from_numpy(scales),
            "b": torch.from_numpy(b_codes), scale_name("b"): torch.from_numpy(b_scales)},
            site=site, round=1, parent=digest, num_samples=4, run_id="run-1", config=CONFIG)

    layout = RunLayout(tmp_path / "run")

    def reason(site: str, path: Path) -> str:
        verdict, manifest = admit(layout, site, 1, parent, path, exchange=exchange)
        assert (verdict.state, manifest) != (SiteState.COMPLETED, None)
        return verdict.reason or ""

    honest, _ = admit(layout, "honest", 1, parent, update("honest"), exchange=exchange)
    assert honest.state == SiteState.COMPLETED, honest.reason
    assert reason("nan", update("nan", float("nan"))) == \
        "tensor 'w.absmax' holds non-finite values (NaN or Inf)"
    assert reason("negative", update("negative", -1.0)) == \
        "tensor 'w' has a negative block scale (-1 in w.absmax); a block's absmax never is"
    # finite codes and scales whose decoded value, added to the global's 3e38, is inf
    assert reason("overflow", update("overflow", big, sign=1.0)) == \
        "its delta of tensor 'w' added to the global model overflows its dtype"
    assert reason("short", update("short", shape_w=1)) == \
        "tensor 'w' has shape [1], the global model has [2]"
    # the plain bf16 reading of the same exchange does not accept nf4 codes either
    plain, _ = admit(layout, "honest", 1, parent, tmp_path / "honest",
                     exchange=ExchangeSpec.parse("delta/bf16"))
    assert plain.state == SiteState.REJECTED
