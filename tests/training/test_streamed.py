"""Checkpoints written tensor by tensor: round 0 from model.init, and training.update_fn."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from xffl.aggregator.exchange import Manifest, read_manifest, verify_checkpoint
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.core.errors import InvalidInput
from xffl.training.arch import build_config
from xffl.training.checkpoint import init_global, read_weights
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.model import PRESETS, build_model, export_state_dict
from xffl.training.streamed import copy_init, delta_value, tensor_update_round


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
    with pytest.raises(InvalidInput, match=r"model\.safetensors: tensor model\.norm\.weight "
                       r"has shape \(7,\), the model expects \(32,\)"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    weights["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"tensor model\.norm\.weight is I64, not a "
                       "floating-point type"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    del weights["model.norm.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(InvalidInput, match=r"missing \['model\.norm\.weight'\]"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_init_names_the_shard_of_a_tensor_that_does_not_fit(
        tmp_path: Path, global0: tuple[Path, object]) -> None:
    g0, _ = global0
    weights = read_weights(g0)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((g0 / "config.json").read_bytes())
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 5)
    entries = [(n, "F32", tuple(v.shape)) for n, v in sorted(weights.items())]
    with ShardedWriter(bad, entries, max_shard_bytes=20_000) as writer:
        for name, _, _ in entries:
            writer.write(name, weights[name].numpy())
    assert writer.sharded
    with pytest.raises(InvalidInput, match=r"model-000\d\d-of-000\d\d\.safetensors: tensor "
                       r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(3, 5\)"):
        init_global("run-test", ModelSpec(init=str(bad)), 0, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_round0_written_by_streaming_equals_the_model_built_in_memory(tmp_path: Path) -> None:
    init_global("run-test", ModelSpec(preset="tiny-test"), 11, tmp_path / "g0")
    streamed = load_file(tmp_path / "g0" / "model.safetensors")
    in_memory = export_state_dict(build_model(PRESETS["tiny-test"], seed=11))
    assert set(streamed) == set(in_memory)
    for name, value in in_memory.items():  # bit for bit
        assert torch.equal(streamed[name], value), name


def test_copy_in_pieces_widens_every_float_type_exactly(
        tmp_path: Path, global0: tuple[Path, object]) -> None:
    """fp32 tensors copied as they are, bf16 and fp16 widened (exact: fp32 holds every bf16
    and fp16 value), float64 rounded once; pieces of 7 elements straddle every tensor."""
    g0, _ = global0
    weights = read_weights(g0)
    kinds = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    source = {n: v.to(kinds[i % 4]) for i, (n, v) in enumerate(sorted(weights.items()))}
    src = tmp_path / "mixed"
    src.mkdir()
    save_file(source, str(src / "model.safetensors"))
    (src / "config.json").write_bytes((g0 / "config.json").read_bytes())
    config = build_config(ModelSpec(init=str(src)))
    copy_init(src, config, None, tmp_path / "out", Manifest(kind="global", run_id="r", round=0),
              None, piece=7)
    got = read_weights(tmp_path / "out")
    assert set(got) == set(source)
    for name, value in source.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value.float()), name


class _One(nn.Module):
    """A model of one matrix."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, 4096))


def big_model(config: object) -> nn.Module:
    """An entry point: one 8 M-element matrix, far larger than a copy's piece."""
    return _One(2048)


def small_model(config: object) -> nn.Module:
    """An entry point: the same matrix with one row."""
    return _One(1)


def _copy_peak(tmp_path: Path, rows: int, entry: str) -> float:
    """Python's peak allocations while copying a bf16 matrix of ``rows`` x 4096 into fp32."""
    src = tmp_path / f"src-{rows}"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    with ShardedWriter(src, [("weight", "BF16", (rows, 4096))]) as writer:
        for _ in range(rows // 256 or 1):
            writer.write_chunk("weight", rng.standard_normal(min(rows, 256) * 4096,
                                                             dtype=np.float32))
    config = build_config(ModelSpec(preset="tiny-test"))
    out = tmp_path / f"out-{rows}"
    tracemalloc.start()
    try:
        copy_init(src, config, f"{__name__}:{entry}", out,
                  Manifest(kind="global", run_id="r", round=0), None, piece=1 << 18)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    got = load_file(out / "model.safetensors")["weight"]
    assert torch.equal(got, load_file(src / "model.safetensors")["weight"].float())
    return peak


def test_copy_memory_is_two_pieces_not_the_tensor(tmp_path: Path) -> None:
    """Copying a 32 MiB (fp32) matrix from bf16 in pieces of 2^18 elements takes at most two
    fp32 pieces (1 MiB each) and two raw bf16 ones (0.5 MiB each) more than copying a
    4096-element one (whose peak is the constant part: the model's meta build, the config,
    the writer's 1 MiB buffer); reading the matrix whole would take 48 MiB more."""
    _copy_peak(tmp_path / "warm", 1, "small_model")  # imports made on first use
    small = _copy_peak(tmp_path, 1, "small_model")
    big = _copy_peak(tmp_path, 2048, "big_model")
    assert big - small <= 3 * 2**20 + (256 << 10), (big - small) / 2**20


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
