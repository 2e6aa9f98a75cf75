"""Sharded checkpoints end to end: the split rule, index checks, aggregation, admission, HF load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import (
    CONFIG_FILE,
    MANIFEST_FILE,
    finalize_manifest,
    read_manifest,
    sha256_file,
    staged_dir,
    verify_checkpoint,
)
from xffl.aggregator.fedavg import aggregate
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import (
    INDEX_FILE,
    MODEL_FILE,
    open_model,
    plan_shards,
    shard_name,
)
from xffl.aggregator.engine import run_strategy, state_file
from xffl.aggregator.verify import check_update, select_updates
from xffl.core.errors import CheckpointError, InvalidInput
from xffl.core.sizes import parse_size

S1, S2, S3 = (shard_name(i, 3) for i in (1, 2, 3))
# F32 tensors; bytes: emb 2400, a.w 480, a.b 48, b.w 480, b.b 48, norm 48 (3504 in all).
SHAPES = {"emb": (50, 12), "a.w": (12, 10), "a.b": (12,), "b.w": (10, 12), "b.b": (12,),
          "norm": (12,)}
SAMPLES = {"alpha": 3, "beta": 5, "gamma": 2}


def reshard(src: Path, dst: Path, max_bytes: int | None) -> Path:
    """Copy a checkpoint with its model re-written by ShardedWriter (same manifest fields)."""
    manifest = read_manifest(src)
    with open_model(src) as model, staged_dir(dst) as tmp:
        order = sorted(model.entries.values(), key=lambda e: (e.name != "emb", e.name))
        entries = [(e.name, e.dtype, e.shape) for e in order]
        with ShardedWriter(tmp, entries, model.metadata, max_shard_bytes=max_bytes) as w:
            for e in order:
                w.write_chunk(e.name, model.raw(e.name))
        shutil.copy(src / CONFIG_FILE, tmp / CONFIG_FILE)
        finalize_manifest(tmp, manifest, checksums=w.checksums)
    return dst


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _updates(base: Path, parent: str | None = None) -> list[Path]:
    return [
        write_checkpoint(base / site, _tensors(i), site=site, num_samples=n, parent=parent,
                         metrics={"loss": float(i)})
        for i, (site, n) in enumerate(SAMPLES.items())
    ]


def _same_tensors(a: Path, b: Path) -> list[str]:
    with open_model(a) as ra, open_model(b) as rb:
        assert ra.names() == rb.names()
        for name in ra.names():
            assert ra.entry(name).dtype == rb.entry(name).dtype
            assert ra.entry(name).shape == rb.entry(name).shape
            assert ra.raw(name).tobytes() == rb.raw(name).tobytes(), name
        return rb.files


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 << 30), ("1.5KB", 1500),
     ("64 kib", 65536), (" 7 ", 7), (1024, 1024), ("0", None), (0, None), (None, None)],
)
def test_parse_size(text: Any, expected: int | None) -> None:
    assert parse_size(text) == expected


def test_parse_size_agrees_with_huggingface_and_rejects_junk() -> None:
    from huggingface_hub.serialization import _base as hub

    for text in ("5GB", "500MB", "1.5KB", "3TB", "0.25GB"):
        assert parse_size(text) == hub.parse_size_to_int(text)
    for bad in ("5 gigs", "GB", "-1MB", "1e3MB", ""):
        with pytest.raises(InvalidInput, match=r"e\.g\. 5GB or 500MB"):
            parse_size(bad)


def test_plan_is_huggingface_hubs_split() -> None:
    assert plan_shards([6, 6, 2, 6, 2, 2], 10) == [[0], [1, 2], [3, 4, 5]]
    assert plan_shards([4, 20, 4, 4], 10) == [[1], [0, 2], [3]]  # big one jumps ahead
    assert plan_shards([20], 10) == [[0]]
    assert plan_shards([3, 0, 7, 0], 10) == [[0, 1, 2, 3]]
    assert plan_shards([5, 5], None) == plan_shards([5, 5], 0) == [[0, 1]]
    assert plan_shards([], 10) == [[]]
    import huggingface_hub as hub

    rng = np.random.default_rng(7)
    for _ in range(40):
        sizes = [int(x) for x in rng.integers(1, 60, size=int(rng.integers(1, 25)))]
        limit = int(rng.integers(10, 120))
        state = {f"t{i:02d}": torch.empty(s, dtype=torch.uint8) for i, s in enumerate(sizes)}
        split = hub.split_torch_state_dict_into_shards(
            state, max_shard_size=limit, filename_pattern="model{suffix}.safetensors"
        )
        plan = plan_shards(sizes, limit)
        names = ([MODEL_FILE] if len(plan) == 1
                 else [shard_name(k, len(plan)) for k in range(1, len(plan) + 1)])
        ours = {names[k]: [f"t{i:02d}" for i in members] for k, members in enumerate(plan)}
        assert ours == split.filename_to_tensors, (sizes, limit)


def _sharded_global(tmp_path: Path) -> Path:
    single = write_checkpoint(tmp_path / "single", _tensors(0), kind="global", site=None)
    # emb first, then by name: [emb] (2400 > 1000), [a.b, a.w, b.b] (+ b.w = 1056), [b.w, norm]
    return reshard(single, tmp_path / "g", 1000)


def test_open_model_reads_both_layouts_and_validates_the_index(tmp_path: Path) -> None:
    g = _sharded_global(tmp_path)
    with open_model(g) as model:
        assert model.files == [S1, S2, S3] and model.index_file == INDEX_FILE
        assert {n: model.shard_of(n).path.name for n in model.names()} == {
            "emb": S1, "a.b": S2, "a.w": S2, "b.b": S2, "b.w": S3, "norm": S3}
        assert model.metadata == {}
        np.testing.assert_array_equal(model.read("b.w"), _tensors(0)["b.w"])
        out = np.empty(5, dtype=np.float32)
        model.read_into("emb", 7, out)
        np.testing.assert_array_equal(out, _tensors(0)["emb"].reshape(-1)[7:12])
        assert [c.size for c in model.chunks("a.w", 50)] == [50, 50, 20]
        with pytest.raises(CheckpointError, match="g: no tensor named 'zzz'"):
            model.entry("zzz")
    index = json.loads((g / INDEX_FILE).read_text())

    def broken(label: str, weight_map: dict[str, str] | None = None, **files: bytes) -> Path:
        d = tmp_path / label
        shutil.copytree(g, d)
        if weight_map is not None:
            (d / INDEX_FILE).write_text(json.dumps({**index, "weight_map": weight_map}))
        for name, data in files.items():
            (d / name).write_bytes(data)
        return d

    (tmp_path / "gone").mkdir()
    cases = {
        "gone": f"neither {MODEL_FILE} nor {INDEX_FILE}",
        "both": f"holds both {MODEL_FILE} and {INDEX_FILE}",
        "missing": f"{INDEX_FILE}: lists {S2}, which is missing",
        "wrong": f"{INDEX_FILE}: tensor 'a.w' is in {S2}, the index says {S3}",
        "absent": f"{INDEX_FILE}: tensor 'ghost' is not in {S3}",
        "extra": f"{S3}: tensor 'norm' is not in {INDEX_FILE}",
        "twice": f"tensor 'emb' is in both {S1} and {S2}",
        "escape": f"{INDEX_FILE}: tensor 'norm' maps to '../x.safetensors', not a shard file name",
        "json": f"{INDEX_FILE}: unreadable JSON",
    }
    wm = dict(index["weight_map"])
    broken("both", **{MODEL_FILE: (g / S1).read_bytes()})
    (broken("missing") / S2).unlink()
    broken("wrong", {**wm, "a.w": S3})
    broken("absent", {**wm, "ghost": S3})
    broken("extra", {k: v for k, v in wm.items() if k != "norm"} | {"x": S1})
    # shard 2 holds emb too: a copy of shard 1 named as shard 2, listed for its tensors
    broken("twice", {"emb": S1, "y": S2, "b.w": S3, "norm": S3}, **{S2: (g / S1).read_bytes()})
    broken("escape", {**wm, "norm": "../x.safetensors"})
    broken("json", **{INDEX_FILE: b"{not json"})
    for label, message in cases.items():
        with pytest.raises(CheckpointError) as err:
            open_model(tmp_path / label)
        assert message in err.value.message, (label, err.value.message)


def test_sharded_fedavg_equals_unsharded_bitwise(tmp_path: Path) -> None:
    ups = _updates(tmp_path / "updates")
    one = aggregate(ups, tmp_path / "one", run_id="run-1", round=1)
    same = aggregate(ups, tmp_path / "same", run_id="run-1", round=1, max_shard_size="4KB")
    many = aggregate(ups, tmp_path / "many", run_id="run-1", round=1, max_shard_size=1000)
    # 3504 bytes <= 4KB: the very same single file as without a limit
    assert (tmp_path / "same" / MODEL_FILE).read_bytes() == (tmp_path / "one" / MODEL_FILE)\
        .read_bytes()
    assert same.files == one.files
    # sorted layout: a.b 48, a.w 480, b.b 48, b.w 480 (1056 > 1000: new shard), emb 2400
    # (> 1000: a shard of its own, before the one being filled), norm 48
    assert _same_tensors(tmp_path / "one", tmp_path / "many") == [S1, S2, S3]
    index = json.loads((tmp_path / "many" / INDEX_FILE).read_text())
    assert index == {"metadata": {"total_size": 3504}, "weight_map": {
        "a.b": S1, "a.w": S1, "b.b": S1, "b.w": S3, "emb": S2, "norm": S3}}
    assert sorted(many.files) == sorted([CONFIG_FILE, INDEX_FILE, S1, S2, S3])
    assert all(many.files[f] == sha256_file(tmp_path / "many" / f) for f in many.files)
    assert many.tensors == one.tensors and many.metrics == one.metrics
    assert verify_checkpoint(tmp_path / "many") == many
    assert not (tmp_path / "many" / MODEL_FILE).exists()
    out = {n: 0.0 for n in SHAPES}
    total = sum(SAMPLES.values())
    for i, n in enumerate(SAMPLES.values()):
        for k, v in _tensors(i).items():
            out[k] = out[k] + n * v.astype(np.float64)
    with open_model(tmp_path / "many") as model:
        for k in SHAPES:
            assert model.read(k).tobytes() == (out[k] / total).astype(np.float32).tobytes()


def test_sharded_inputs_and_previous_give_the_same_result(tmp_path: Path) -> None:
    g0 = write_checkpoint(tmp_path / "g0", _tensors(9), kind="global", site=None, round=0)
    ups = _updates(tmp_path / "u", parent=read_manifest(g0).digest())
    sharded = [reshard(u, tmp_path / "su" / u.name, 700) for u in ups]
    assert (sharded[0] / INDEX_FILE).is_file() and not (sharded[0] / MODEL_FILE).exists()
    aggregate(ups, tmp_path / "a1")
    aggregate(sharded, tmp_path / "a2")
    assert (tmp_path / "a1" / MODEL_FILE).read_bytes() == (tmp_path / "a2" / MODEL_FILE)\
        .read_bytes()
    # a stateful strategy over sharded updates and a sharded previous global, two rounds
    sg0 = reshard(g0, tmp_path / "sg0", 700)
    run_strategy("fedadam", ups, g0, tmp_path / "r1")
    run_strategy("fedadam", sharded, sg0, tmp_path / "s1", max_shard_size=700)
    assert _same_tensors(tmp_path / "r1", tmp_path / "s1") == [S1, S2, S3]
    run_strategy("fedadam", ups, tmp_path / "r1", tmp_path / "r2")
    m = run_strategy("fedadam", sharded, tmp_path / "s1", tmp_path / "s2", max_shard_size=700)
    _same_tensors(tmp_path / "r2", tmp_path / "s2")
    assert m.extra["server_state"]["loaded_from"] == str(tmp_path / "s1")
    for b in ("m", "v"):
        assert (tmp_path / "r2" / state_file(b)).read_bytes() == (tmp_path / "s2" /
                                                                  state_file(b)).read_bytes()
    verify_checkpoint(tmp_path / "s2")


def test_verify_admits_sharded_updates_and_rejects_damaged_ones(tmp_path: Path) -> None:
    g0 = write_checkpoint(tmp_path / "g0", _tensors(9), kind="global", site=None, round=0)
    parent = read_manifest(g0).digest()
    base = tmp_path / "plain"
    sites = ["good", "missing", "wrong", "flipped", "unlisted", "tampered"]
    dirs = {
        s: reshard(write_checkpoint(base / s, _tensors(i), site=s, parent=parent),
                   tmp_path / "up" / s, 1000)
        for i, s in enumerate(sites)
    }
    (dirs["missing"] / S2).unlink()
    index = json.loads((dirs["wrong"] / INDEX_FILE).read_text())
    index["weight_map"]["a.w"] = S3
    (dirs["wrong"] / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    manifest = read_manifest(dirs["wrong"])  # re-sign the index so only its content is wrong
    manifest.files[INDEX_FILE] = sha256_file(dirs["wrong"] / INDEX_FILE)
    (dirs["wrong"] / MANIFEST_FILE).write_text(manifest.model_dump_json())
    data = bytearray((dirs["flipped"] / S2).read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's data: the header still parses
    (dirs["flipped"] / S2).write_bytes(bytes(data))
    manifest = read_manifest(dirs["unlisted"])
    del manifest.files[S3]
    (dirs["unlisted"] / MANIFEST_FILE).write_text(manifest.model_dump_json())
    (dirs["tampered"] / INDEX_FILE).write_text((dirs["tampered"] / INDEX_FILE).read_text() + " ")

    assert check_update(dirs["good"], expected_parent=parent, expected_round=1,
                        reference_index=read_manifest(g0).tensors).site == "good"
    accepted, rejected = select_updates(list(dirs.values()), expected_parent=parent,
                                        reference_index=read_manifest(g0).tensors)
    assert [d.name for d, _ in accepted] == ["good"]
    assert {site: reason for _, site, reason in rejected} == {
        "missing": f"{S2} is missing",
        "wrong": f"{INDEX_FILE}: tensor 'a.w' is in {S2}, the index says {S3}",
        "flipped": f"checksum mismatch for {S2} (corrupted or altered in transfer)",
        "unlisted": f"the manifest does not list {S3}, named in {INDEX_FILE}",
        "tampered": f"checksum mismatch for {INDEX_FILE}",
    }
    with pytest.raises(CheckpointError, match=f"checksum mismatch for {S2}"):
        verify_checkpoint(dirs["flipped"])
    with pytest.raises(CheckpointError, match=f"does not list {S3}"):
        verify_checkpoint(dirs["unlisted"])
    with pytest.raises(CheckpointError, match=rf"up/wrong: {INDEX_FILE}: tensor 'a.w' is in"):
        verify_checkpoint(dirs["wrong"])


def test_transformers_loads_a_sharded_global_with_the_same_logits(tmp_path: Path) -> None:
    import transformers

    from xffl.training.checkpoint import init_global, load_model, read_weights
    from xffl.training.config import ModelSpec

    init_global("hf", ModelSpec(preset="tiny-test"), 1, tmp_path / "g0")
    config = json.loads((tmp_path / "g0" / CONFIG_FILE).read_text())
    base = read_weights(tmp_path / "g0")
    gen = torch.Generator().manual_seed(0)
    ups = [
        write_checkpoint(tmp_path / "u" / site,
                         {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in
                          base.items()},
                         site=site, num_samples=n, config=config)
        for site, n in SAMPLES.items()
    ]
    aggregate(ups, tmp_path / "one")
    aggregate(ups, tmp_path / "many", max_shard_size="20KB")
    files = _same_tensors(tmp_path / "one", tmp_path / "many")
    total = sum(v.numel() * 4 for v in base.values())
    count = len(plan_shards([base[k].numel() * 4 for k in sorted(base)], 20_000))
    assert count >= 3 and files == [shard_name(i, count) for i in range(1, count + 1)]
    assert json.loads((tmp_path / "many" / INDEX_FILE).read_text())["metadata"] == {
        "total_size": total}
    ids = torch.randint(0, 256, (2, 24), generator=gen)
    with torch.no_grad():
        one = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "one").eval()
        many = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "many").eval()
        for k, v in one.state_dict().items():
            assert torch.equal(v, many.state_dict()[k]), k
        logits = many(ids).logits
        assert torch.equal(one(ids).logits, logits)
        # xffl's model is op for op transformers' except the attention core's SDPA path
        # (tests/training/test_hf_compat.py): 2 layers x (8 + 2 x 24) summed terms in
        # another order, logits' sums S_z <= 0.8: <= 2 * 112 * 2^-24 * 0.8 = 1.1e-5, atol
        # 4e-5 (a wrong tensor or rope_theta moves the logits by >= 1e-3)
        torch.testing.assert_close(load_model(tmp_path / "many").eval()(ids), logits,
                                   atol=4e-5, rtol=0)
    ours = read_weights(tmp_path / "many")
    assert ours.keys() == read_weights(tmp_path / "one").keys()
    assert all(torch.equal(v, read_weights(tmp_path / "one")[k]) for k, v in ours.items())
