"""Tests of the sharded writer: Hugging Face's split, file names and index json, header first."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from xffl.aggregator.exchange import sha256_file
from xffl.aggregator.safetensors_io import SafetensorsReader, SafetensorsWriter
from xffl.aggregator.shard_writer import ShardedWriter
from xffl.aggregator.shards import INDEX_FILE, MODEL_FILE, open_model
from xffl.core.errors import CheckpointError

# name -> (dtype, shape); data bytes: a 4*25*4=400, big 4*300=1200, c 2*100=200 (bf16),
# d 8*30=240, e 4*60=240, f 0, g 1*80=80.
ENTRIES = [
    ("a", "F32", (4, 25)),
    ("big", "F32", (300,)),
    ("c", "BF16", (10, 10)),
    ("d", "I64", (30,)),
    ("e", "F32", (60,)),
    ("f", "F32", (0, 3)),
    ("g", "U8", (80,)),
]
NBYTES = {"a": 400, "big": 1200, "c": 200, "d": 240, "e": 240, "f": 0, "g": 80}
NP_DTYPES = {"F32": np.float32, "BF16": np.uint16, "I64": np.int64, "U8": np.uint8}


def _arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, dtype, shape in ENTRIES:
        if dtype == "F32":
            out[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            out[name] = rng.integers(0, 200, size=shape).astype(NP_DTYPES[dtype])
    return out


def _write(directory: Path, limit: int | None, chunk: int | None = None) -> ShardedWriter:
    directory.mkdir(parents=True, exist_ok=True)
    arrays = _arrays()
    with ShardedWriter(directory, ENTRIES, {"format": "pt"}, max_shard_bytes=limit) as w:
        for name, _, _ in ENTRIES:
            flat = arrays[name].reshape(-1)
            if chunk is None:
                w.write(name, arrays[name])
            else:
                for lo in range(0, max(1, flat.size), chunk):
                    w.write_chunk(name, flat[lo : lo + chunk])
    return w


def test_no_limit_or_a_model_below_it_writes_todays_single_file(tmp_path: Path) -> None:
    reference = tmp_path / "ref" / MODEL_FILE
    reference.parent.mkdir()
    arrays = _arrays()
    with SafetensorsWriter(reference, ENTRIES, {"format": "pt"}) as single:
        for name, _, _ in ENTRIES:
            single.write(name, arrays[name])
    total = sum(NBYTES.values())
    assert total == 2360
    for label, limit in (("none", None), ("zero", 0), ("exact", total), ("more", 10**9)):
        w = _write(tmp_path / label, limit, chunk=7)
        assert not w.sharded and w.shard_files == [MODEL_FILE]
        assert sorted(p.name for p in (tmp_path / label).iterdir()) == [MODEL_FILE]
        assert (tmp_path / label / MODEL_FILE).read_bytes() == reference.read_bytes()
        assert w.checksums == {MODEL_FILE: single.sha256}


def test_split_follows_huggingface_and_index_is_transformers_format(tmp_path: Path) -> None:
    # limit 600: a (400) opens shard A; big (1200 > 600) gets its own shard, placed *before*
    # the one being filled; c (+200 = 600) still fits A; d (+240) overflows -> B = d, e (480);
    # f (0) joins B; g (+80 = 560) joins B.  Shards: [big], [a, c], [d, e, f, g].
    w = _write(tmp_path / "m", 600, chunk=64)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert w.sharded and w.shard_files == names
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert files == sorted([*names, INDEX_FILE])
    layout = {}
    for name in names:
        with SafetensorsReader(tmp_path / "m" / name) as r:
            layout[name] = sorted(r.entries)
            assert r.metadata == {"format": "pt"}
            assert r.size - r.data_start == sum(NBYTES[t] for t in r.entries)
    assert layout == {names[0]: ["big"], names[1]: ["a", "c"], names[2]: ["d", "e", "f", "g"]}
    expected_index = (
        "{\n"
        '  "metadata": {\n'
        '    "total_size": 2360\n'
        "  },\n"
        '  "weight_map": {\n'
        f'    "a": "{names[1]}",\n'
        f'    "big": "{names[0]}",\n'
        f'    "c": "{names[1]}",\n'
        f'    "d": "{names[2]}",\n'
        f'    "e": "{names[2]}",\n'
        f'    "f": "{names[2]}",\n'
        f'    "g": "{names[2]}"\n'
        "  }\n"
        "}\n"
    )
    assert (tmp_path / "m" / INDEX_FILE).read_text() == expected_index
    assert w.checksums == {f: sha256_file(tmp_path / "m" / f) for f in files}
    arrays = _arrays()
    for name in names:
        for key, value in safetensors.torch.load_file(tmp_path / "m" / name).items():
            want = arrays[key]
            assert tuple(value.shape) == want.shape
            assert value.reshape(-1).view(torch.uint8).numpy().tobytes() == want.tobytes(), key
    with open_model(tmp_path / "m") as model:
        assert model.files == names and model.index_file == INDEX_FILE
        assert model.read("e").tobytes() == arrays["e"].tobytes()
        assert model.raw("c", 3, 9).tolist() == arrays["c"].reshape(-1)[3:9].tolist()


def test_whole_and_chunked_writes_give_identical_files(tmp_path: Path) -> None:
    _write(tmp_path / "whole", 500)
    _write(tmp_path / "pieces", 500, chunk=13)
    whole = sorted((tmp_path / "whole").iterdir())
    # 500: [big], [a], [c, d], [e, f, g]
    assert [p.name for p in whole] == [
        *(f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)), INDEX_FILE
    ]
    for p in whole:
        assert p.read_bytes() == (tmp_path / "pieces" / p.name).read_bytes()


def test_index_matches_what_transformers_save_pretrained_writes(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    theirs = (tmp_path / "hf" / INDEX_FILE).read_text()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    entries = [(k, "F32", v.shape) for k, v in state.items()]
    (tmp_path / "ours").mkdir()
    with ShardedWriter(tmp_path / "ours", entries, {"format": "pt"}, max_shard_bytes=40_000) as w:
        for k, v in state.items():
            w.write(k, v)
    ours = (tmp_path / "ours" / INDEX_FILE).read_text()
    parsed = json.loads(theirs)
    total_size = sum(v.nbytes for v in state.values())
    assert parsed["metadata"]["total_size"] == total_size
    assert json.loads(ours) == {"metadata": {"total_size": total_size},
                                "weight_map": parsed["weight_map"]}
    # transformers >= 5 adds "total_parameters"; the rest is byte for byte the same text.
    parsed["metadata"].pop("total_parameters", None)
    assert ours == json.dumps(parsed, indent=2, sort_keys=True) + "\n"
    assert sorted(set(parsed["weight_map"].values())) == w.shard_files
    assert len(w.shard_files) >= 3
    for f in w.shard_files:  # same tensors, same bytes in each shard
        mine = safetensors.numpy.load_file(str(tmp_path / "ours" / f))
        hf = safetensors.numpy.load_file(str(tmp_path / "hf" / f))
        assert mine.keys() == hf.keys()
        assert all(mine[k].tobytes() == hf[k].tobytes() for k in mine)


def test_out_of_order_and_incomplete_writes_leave_nothing(tmp_path: Path) -> None:
    arrays = _arrays()
    (tmp_path / "m").mkdir()
    w = ShardedWriter(tmp_path / "m", ENTRIES, max_shard_bytes=600)
    w.write("a", arrays["a"])
    with pytest.raises(CheckpointError, match=r"expected tensor 'big' next .*got 'c'"):
        w.write("c", arrays["c"])
    w.write("big", arrays["big"])  # the big shard is complete and closed
    assert (tmp_path / "m" / "model-00001-of-00003.safetensors").is_file()
    with pytest.raises(CheckpointError, match="tensor 'c' was not written"):
        w.close()
    assert list((tmp_path / "m").iterdir()) == []
    w2 = ShardedWriter(tmp_path / "m", ENTRIES, max_shard_bytes=600)
    with pytest.raises(RuntimeError), w2:
        w2.write("a", arrays["a"])
        w2.write("big", arrays["big"])
        raise RuntimeError("interrupted")
    assert list((tmp_path / "m").iterdir()) == []
    with pytest.raises(CheckpointError, match="duplicate tensor name 'x'"):
        ShardedWriter(tmp_path / "m", [("x", "F32", (1,)), ("y", "F32", (1,)), ("x", "F32", (1,))])


def test_checksums_only_after_close(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    w = ShardedWriter(tmp_path / "m", [("x", "F32", (2,))], max_shard_bytes=4)
    with pytest.raises(CheckpointError, match="checksums are known after close"):
        _ = w.checksums
    w.write("x", torch.ones(2).numpy())
    w.close()
    data = (tmp_path / "m" / MODEL_FILE).read_bytes()
    assert w.checksums == {MODEL_FILE: hashlib.sha256(data).hexdigest()}  # one big tensor
