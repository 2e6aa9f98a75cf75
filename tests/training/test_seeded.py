"""Seeded round 0: values fixed by (seed, name, position), streamed with bounded memory."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from xffl.aggregator.exchange import Manifest, verify_checkpoint
from xffl.aggregator.shards import open_model
from xffl.training import seeded
from xffl.training.seeded import BLOCK, TensorInit, seeded_chunks, seeded_tensor, write_seeded

NORMAL = TensorInit("model.layers.0.mlp.up_proj.weight", (3, BLOCK // 2 + 5), "normal", 0.02)


def test_blocks_depend_on_seed_name_and_position_only() -> None:
    blocks = list(seeded_chunks(7, NORMAL))
    assert [b.size for b in blocks] == [BLOCK, 3 * (BLOCK // 2 + 5) - BLOCK]
    assert all(b.dtype == np.float32 for b in blocks)
    # a block is the same drawn alone, from a tensor of another shape, or in another order
    longer = TensorInit(NORMAL.name, (5, BLOCK), "normal", 0.02)
    assert np.array_equal(seeded.seeded_block(7, longer, 1)[:blocks[1].size], blocks[1])
    assert np.array_equal(seeded.seeded_block(7, NORMAL, 0), blocks[0])
    whole = seeded_tensor(7, NORMAL)
    assert torch.equal(whole.reshape(-1), torch.from_numpy(np.concatenate(blocks)))
    assert whole.shape == NORMAL.shape
    # ... and changes with the seed, the name and the block
    other = TensorInit("model.layers.1.mlp.up_proj.weight", NORMAL.shape, "normal", 0.02)
    assert not np.array_equal(next(seeded_chunks(8, NORMAL)), blocks[0])
    assert not np.array_equal(next(seeded_chunks(7, other)), blocks[0])
    assert not np.array_equal(blocks[1], blocks[0][:blocks[1].size])
    # N(0, 0.02): over 1.5 M draws the sample std is within 0.1 % of 0.02 with overwhelming
    # probability (its relative standard error is 1/sqrt(2n) = 0.06 %); the mean within
    # 5 standard errors (0.02 / sqrt(n) = 1.6e-5)
    values = whole.double()
    assert abs(float(values.std()) / 0.02 - 1) < 3e-3 and abs(float(values.mean())) < 8e-5


def test_constant_and_uniform_rules() -> None:
    ones = seeded_tensor(0, TensorInit("model.norm.weight", (70,), "constant", 1.0))
    assert torch.equal(ones, torch.ones(70))
    bound = 1 / 8
    uni = seeded_tensor(3, TensorInit("a.lora_A.weight", (16, 64), "uniform", bound))
    assert float(uni.abs().max()) <= bound and float(uni.min()) < -0.9 * bound
    assert float(uni.max()) > 0.9 * bound
    with pytest.raises(ValueError, match="seed must be at least 0"):
        seeded.seeded_block(-1, NORMAL, 0)


def test_streamed_checkpoint_has_the_in_memory_values(tmp_path: Path) -> None:
    layout = [TensorInit("a.weight", (BLOCK + 3,), "normal", 0.5),
              TensorInit("b.bias", (9,), "constant", 0.0),
              TensorInit("c.empty", (0, 4), "normal", 0.02),
              TensorInit("d.norm.weight", (11,), "constant", 1.0)]
    manifest = Manifest(kind="global", run_id="r", round=0)
    out = tmp_path / "g"
    # shards smaller than a.weight: sharding must not change a value either
    written = write_seeded(layout, 4, out, manifest, b'{"model_type": "x"}\n', 1 << 20)
    assert verify_checkpoint(out) == written and len(written.files) == 4  # 2 shards, index, config
    with open_model(out) as reader:
        got = {n: torch.from_numpy(np.array(reader.read(n))) for n in reader.names()}
    for init in layout:
        assert torch.equal(got[init.name], seeded_tensor(4, init)), init.name
    assert (out / "config.json").read_bytes() == b'{"model_type": "x"}\n'


def test_streaming_memory_is_a_few_blocks_not_the_tensor(tmp_path: Path) -> None:
    """64 blocks (256 MiB) written: Python's allocations peak at the blocks in flight.

    At most AHEAD blocks wait in the queue, one per generating thread is being drawn and one
    is being written: (AHEAD + 4 + 1) x 4 MiB = 44 MiB with 4 threads. A writer that
    materialised the tensor would allocate its 256 MiB.
    """
    layout = [TensorInit("big.weight", (64, BLOCK), "normal", 0.02)]
    tracemalloc.start()
    try:
        write_seeded(layout, 0, tmp_path / "g", Manifest(kind="global", run_id="r", round=0),
                     b"{}", None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= (seeded.AHEAD + 5) * BLOCK * 4 + (8 << 20), peak / 2**20
    # the 256 MiB did get written
    assert (tmp_path / "g" / "model.safetensors").stat().st_size > 64 * BLOCK * 4



def test_bytes_do_not_depend_on_how_far_ahead_blocks_are_drawn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = [TensorInit("w", (3, BLOCK), "normal", 0.02), TensorInit("n.bias", (5,),
                                                                       "constant", 0.0)]
    sums = []
    for ahead, cpus in ((1, 1), (seeded.AHEAD, 8)):
        monkeypatch.setattr(seeded, "AHEAD", ahead)
        monkeypatch.setattr(seeded.os, "cpu_count", lambda cpus=cpus: cpus)
        out = tmp_path / f"g{ahead}"
        sums.append(write_seeded(layout, 1, out, Manifest(kind="global", run_id="r", round=0),
                                 b"{}", None).files["model.safetensors"])
    assert sums[0] == sums[1]
