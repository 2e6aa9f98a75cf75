"""Checkpoints written tensor by tensor: round 0 from model.init, and training.update_fn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from xffl.aggregator.exchange import read_manifest, verify_checkpoint
from xffl.aggregator.fedavg import aggregate
from xffl.core.errors import InvalidInput
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.streamed import delta_value, tensor_update_round
from xffl.training.trainer import init_global, read_weights


def _job(update_fn: str, site: str = "alpha") -> TrainJob:
    return TrainJob(run_id="run-test", site=site, model=ModelSpec(preset="tiny-test"),
                    training=TrainingSpec(steps=3, batch_size=5, update_fn=update_fn),
                    data=DataSpec(path="unused"))


def test_init_from_a_bf16_checkpoint_is_converted_tensor_by_tensor(
        tmp_path: Path, global0: tuple[Path, object]) -> None:
    g0, _ = global0
    weights = read_weights(g0)
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    (bf16 / "config.json").write_bytes((g0 / "config.json").read_bytes())
    manifest = init_global("run-test", ModelSpec(init=str(bf16)), 0, tmp_path / "out",
                           max_shard_bytes=20_000)  # also: sharded as Hugging Face does
    assert verify_checkpoint(tmp_path / "out") == manifest
    assert len([f for f in manifest.files if f.startswith("model-")]) > 1
    got = read_weights(tmp_path / "out")
    assert set(got) == set(weights)
    for name, value in weights.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], value.to(torch.bfloat16).float()), name
    assert manifest.extra["num_parameters"] == sum(v.numel() for v in weights.values())


def test_init_that_does_not_fit_the_model_is_refused(tmp_path: Path,
                                                     global0: tuple[Path, object]) -> None:
    g0, _ = global0
    weights = read_weights(g0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((g0 / "config.json").read_bytes())
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"model\.norm\.weight has shape \(7,\), the model "
                       r"expects \(32,\)"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    del weights["model.norm.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"missing \['model\.norm\.weight'\]"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_update_fn_adds_the_delta_and_fedavg_gives_the_mean(
        tmp_path: Path, global0: tuple[Path, object]) -> None:
    g0, g0_manifest = global0
    fn = "xffl.training.streamed:add_delta"
    ups = [tmp_path / s for s in ("alpha", "beta")]
    for site, out in zip(("alpha", "beta"), ups, strict=True):
        manifest = tensor_update_round(_job(fn, site), 2, g0, out)
        assert verify_checkpoint(out) == manifest == read_manifest(out)
        assert (manifest.kind, manifest.site, manifest.round, manifest.num_samples) == \
            ("update", site, 2, 15)
        assert manifest.parent == g0_manifest.digest()  # type: ignore[attr-defined]
    base = load_file(str(g0 / "model.safetensors"))
    one = load_file(str(ups[0] / "model.safetensors"))
    for name, value in base.items():
        assert torch.equal(one[name], value + torch.tensor(delta_value("alpha", 2, name)))
    aggregate(ups, tmp_path / "global")
    mean = load_file(str(tmp_path / "global" / "model.safetensors"))
    # Tolerance: each update is w + d rounded once to fp32 (half an ulp), FedAvg's float64
    # mean of the two (equal weights) is exact up to 2^-53 and rounded once more, and the
    # expected value is w + shift rounded once: both results lie on the fp32 grid within
    # 1.5 ulps of w + shift, so they are equal or 1 ulp apart, and |w + d| < 2 (weights
    # |w| <= 1, 0 < d <= 2e-3) makes 1 ulp <= 2^-23 = spacing(1.0). A lost or doubled
    # delta (>= 1e-6) or unequal weights would be off by far more.
    for name, value in base.items():
        shift = (delta_value("alpha", 2, name) + delta_value("beta", 2, name)) / 2
        np.testing.assert_allclose(mean[name].numpy(), value.numpy() + shift, rtol=0,
                                   atol=float(np.spacing(np.float32(1.0))))
    assert delta_value("alpha", 2, "x") == 2 * delta_value("alpha", 1, "x") != \
        delta_value("beta", 2, "x")


def _bad_shape(name: str, value: np.ndarray, context: object) -> np.ndarray:
    return value.reshape(-1)[:1]


def test_update_fn_errors(tmp_path: Path, global0: tuple[Path, object]) -> None:
    g0, _ = global0
    with pytest.raises(InvalidInput, match="cannot import no_such_module"):
        tensor_update_round(_job("no_such_module:f"), 1, g0, tmp_path / "a")
    with pytest.raises(InvalidInput, match="has no function nothing"):
        tensor_update_round(_job("xffl.training.streamed:nothing"), 1, g0, tmp_path / "b")
    with pytest.raises(InvalidInput, match="returned shape"):
        tensor_update_round(_job(f"{__name__}:_bad_shape"), 1, g0, tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")
