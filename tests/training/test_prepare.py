"""`prepare`: text files to token shards, byte-level and through a real tokenizer.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from xffl.aggregator.exchange import Manifest
from xffl.core.errors import InvalidInput
from xffl.training import prepare as prep
from xffl.training.config import DataSpec, ModelSpec, TrainingSpec, TrainJob
from xffl.training.data import TokenShards, load_tokens, read_meta
from xffl.training.prepare import prepare
from xffl.training.trainer import train_round

TEXT_A = "the quick brown fox jumps over the lazy dog\n" * 40 + "ünïcödé line\n"
TEXT_B = "pack my box with five dozen liquor jugs\n" * 30


@pytest.fixture
def texts(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT_A, encoding="utf-8")
    b.write_text(TEXT_B, encoding="utf-8")
    return [a, b]


def test_bytes(tmp_path: Path, texts: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "PIECE_BYTES", 64)  # many pieces
    meta = prepare(texts, tmp_path / "out")
    raw = TEXT_A.encode() + TEXT_B.encode()
    tokens = load_tokens(tmp_path / "out")
    assert tokens.dtype == np.uint16
    assert np.array_equal(tokens, np.frombuffer(raw, dtype=np.uint8))
    assert meta == read_meta(tmp_path / "out")
    assert (meta["num_tokens"], meta["vocab_size"], meta["tokenizer"]) == (len(raw), 256, "bytes")
    assert [s["sha256"] for s in meta["sources"]] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in texts]
    assert len(TokenShards(tmp_path / "out", 31)) == len(raw) // 32


def test_tokenizer_json(tmp_path: Path, texts: list[Path], tokenizer_json: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "PIECE_BYTES", 50)  # cut at line ends, many pieces
    meta = prepare(texts, tmp_path / "out", tokenizer=tokenizer_json, eos="</s>")
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("</s>")
    ids_a = tok.encode(TEXT_A, add_special_tokens=False).ids
    ids_b = tok.encode(TEXT_B, add_special_tokens=False).ids
    expected = [*ids_a, eos, *ids_b, eos]
    assert load_tokens(tmp_path / "out").tolist() == expected
    assert meta["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) <= 120
    assert meta["tokenizer"]["eos"] == "</s>"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    assert [s["tokens"] for s in meta["sources"]] == [
        len(tok.encode(TEXT_A).ids) + 1, len(tok.encode(TEXT_B).ids) + 1]


def test_trains_on_prepared_data(tmp_path: Path, texts: list[Path], tokenizer_json: Path,
                                 global0: tuple[Path, Manifest]) -> None:
    data = tmp_path / "data"
    prepare(texts, data, tokenizer=tokenizer_json)
    job = TrainJob(run_id="run-test", site="site-a", model=ModelSpec(preset="tiny-test"),
                   training=TrainingSpec(steps=2, batch_size=2, seq_len=16),
                   data=DataSpec(path=str(data)))
    manifest = train_round(job, 1, global0[0], data, tmp_path / "update")
    # real data of undeclared size: the samples the round read (2 steps x 2), which the
    # coordinator can bound; declared (data.max_samples), the dataset's size
    assert manifest.num_samples == 2 * 2 < len(TokenShards(data, 16))
    declared = job.model_copy(update={"data": DataSpec(path=str(data), max_samples=1000)})
    manifest = train_round(declared, 1, global0[0], data, tmp_path / "update-declared")
    assert manifest.num_samples == len(TokenShards(data, 16))


def test_bad_input(tmp_path: Path, texts: list[Path], tokenizer_json: Path) -> None:
    with pytest.raises(InvalidInput, match=r"missing.txt: no such file"):
        prepare([tmp_path / "missing.txt"], tmp_path / "o1")
    with pytest.raises(InvalidInput, match="--eos needs --tokenizer"):
        prepare(texts, tmp_path / "o2", eos="</s>")
    with pytest.raises(InvalidInput, match="no token '<eos>' for --eos"):
        prepare(texts, tmp_path / "o3", tokenizer=tokenizer_json, eos="<eos>")
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(InvalidInput, match=r"not a Hugging Face tokenizer\.json"):
        prepare(texts, tmp_path / "o4", tokenizer=bogus)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))
    prepare(texts, tmp_path / "o5")
    with pytest.raises(InvalidInput, match="is not empty; choose a new directory or pass"):
        prepare(texts[:1], tmp_path / "o5")
    assert read_meta(tmp_path / "o5")["num_tokens"] == len((TEXT_A + TEXT_B).encode())
    assert prepare(texts[:1], tmp_path / "o5", force=True)["num_tokens"] == len(TEXT_A.encode())
