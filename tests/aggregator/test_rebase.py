"""A late update's change moved onto the current global: w + s (u - w0), per dtype, rounded once."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.rebase import rebase


def test_rebase_is_the_formula_in_float64_rounded_once_to_each_dtype(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)

    def model(folder: str, kind: str, **fields: object) -> Path:
        tensors = {"a": torch.randn(3, 5, generator=gen),
                   "b": torch.randn(7, generator=gen).to(torch.bfloat16),
                   "empty": torch.zeros(0)}
        return write_checkpoint(tmp_path / folder, tensors, kind=kind, **fields)  # type: ignore[arg-type]

    w0 = model("w0", "global", site=None, round=0)
    w = model("w", "global", site=None, round=1, parent=read_manifest(w0).digest())
    u = model("u", "update", site="beta", round=1, parent=read_manifest(w0).digest(),
              num_samples=6, num_tokens=96, metrics={"loss": 2.5})
    out = rebase(u, w0, w, 0.25, tmp_path / "out", 2)
    assert verify_checkpoint(tmp_path / "out") == out
    assert (out.kind, out.round, out.site, out.parent) == ("update", 2, "beta",
                                                           read_manifest(w).digest())
    assert (out.num_samples, out.num_tokens, out.metrics) == (6, 96, {"loss": 2.5})
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    t = {k: load_file(str(p / "model.safetensors")) for k, p in (("w0", w0), ("w", w), ("u", u))}
    for name, dtype in (("a", torch.float32), ("b", torch.bfloat16), ("empty", torch.float32)):
        exact = t["w"][name].double() + 0.25 * (t["u"][name].double() - t["w0"][name].double())
        assert got[name].dtype == dtype and got[name].shape == exact.shape
        # one rounding of the float64 value to the dtype: exactly what torch's cast gives
        # (bf16 through float32, round to nearest even, as the aggregator encodes)
        assert torch.equal(got[name], exact.to(torch.float32).to(dtype)), name
