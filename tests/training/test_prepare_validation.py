"""`prepare(..., validation_fraction=F)`: the last F of every file, held out in OUT/validation."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from xffl.core.errors import InvalidInput
from xffl.training import prepare as prep
from xffl.training.data import TokenShards, load_tokens, read_meta
from xffl.training.prepare import prepare

TEXT_A = b"alpha line\n" * 10  # 110 bytes, lines of 11
TEXT_B = "beta: ünïcödé text here\n".encode() * 6 + b"last line without end"


def line_split(data: bytes, fraction: float) -> tuple[bytes, bytes]:
    """(head, tail) by the rule, found another way: the first line start >= the offset."""
    offset = len(data) - math.floor(len(data) * fraction)
    starts = [0, *(i + 1 for i, byte in enumerate(data) if byte == ord("\n"))]
    cut = min((s for s in starts if s >= offset), default=offset)
    return data[:cut], data[cut:]


@pytest.fixture
def texts(tmp_path: Path) -> list[Path]:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(TEXT_A)
    b.write_bytes(TEXT_B)
    return [a, b]


def test_the_rule_by_hand() -> None:
    # a: 110 - floor(27.5) = 83, the next line start is 88: the last 2 lines (22 bytes)
    assert line_split(TEXT_A, 0.25) == (TEXT_A[:88], b"alpha line\n" * 2)
    # b: 189 - floor(47.25) = 142, lines of 28 bytes start at 140, 168: the unended last line
    assert len(TEXT_B) == 189 and line_split(TEXT_B, 0.25) == (TEXT_B[:168],
                                                               b"last line without end")


@pytest.mark.parametrize("piece", [7, 64, 4 << 20])
def test_bytes(tmp_path: Path, texts: list[Path], piece: int,
               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "PIECE_BYTES", piece)  # 7: many pieces, cut inside lines too
    out = tmp_path / "out"
    meta = prepare(texts, out, validation_fraction=0.25)
    (head_a, tail_a), (head_b, tail_b) = line_split(TEXT_A, 0.25), line_split(TEXT_B, 0.25)
    train, held = load_tokens(out), load_tokens(out / "validation")
    assert bytes(train.astype(np.uint8)) == head_a + head_b
    assert bytes(held.astype(np.uint8)) == tail_a + tail_b
    assert (len(train), len(held)) == (88 + 168, 22 + 21)
    assert len(train) + len(held) == len(TEXT_A + TEXT_B)
    assert meta == read_meta(out)
    assert meta["validation"] == {"fraction": 0.25, "num_tokens": 43, "path": "validation"}
    assert [s["tokens"] for s in meta["sources"]] == [88, 168]
    vmeta = read_meta(out / "validation")
    sha = [hashlib.sha256(p.read_bytes()).hexdigest() for p in texts]
    assert vmeta == {
        "dtype": "uint16", "num_tokens": 43, "vocab_size": 256, "tokenizer": "bytes",
        "sources": [
            {"path": str(texts[0].resolve()), "bytes": 110, "sha256": sha[0], "offset": 88,
             "tokens": 22},
            {"path": str(texts[1].resolve()), "bytes": 189, "sha256": sha[1], "offset": 168,
             "tokens": 21}],
        "split": "validation"}
    assert sorted(p.name for p in (out / "validation").iterdir()) == ["meta.json", "train.bin"]
    assert len(TokenShards(out / "validation", 12)) == 43 // 13


def test_tokenizer_json_and_eos(tmp_path: Path, texts: list[Path], tokenizer_json: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "PIECE_BYTES", 30)
    out = tmp_path / "out"
    meta = prepare(texts, out, tokenizer=tokenizer_json, eos="</s>", validation_fraction=0.3)
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("</s>")

    def ids(data: bytes) -> list[int]:
        return list(tok.encode(data.decode(), add_special_tokens=False).ids)

    splits = [line_split(TEXT_A, 0.3), line_split(TEXT_B, 0.3)]
    want_train = [t for head, _ in splits for t in (*ids(head), eos)]
    want_held = [t for _, tail in splits for t in (*ids(tail), eos)]
    assert load_tokens(out).tolist() == want_train
    assert load_tokens(out / "validation").tolist() == want_held
    assert len(want_train) + len(want_held) == sum(len(ids(p.read_bytes())) + 2 for p in texts)
    vmeta = read_meta(out / "validation")
    for key in ("dtype", "vocab_size", "tokenizer"):
        assert vmeta[key] == meta[key]
    assert vmeta["split"] == "validation" and meta["tokenizer"]["eos"] == "</s>"
    assert [s["tokens"] for s in vmeta["sources"]] == [len(ids(t)) + 1 for _, t in splits]
    assert meta["validation"]["num_tokens"] == len(want_held) == vmeta["num_tokens"]
    assert (out / "validation" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()


def test_without_a_newline_the_cut_is_after_a_space_or_on_a_character(tmp_path: Path) -> None:
    words, chars = tmp_path / "words.txt", tmp_path / "chars.txt"
    words.write_bytes(b"one two three four five six")  # 27 bytes: 27 - 6 = 21, in "five"
    chars.write_bytes("é".encode() * 50)  # 100 bytes: 100 - 25 = 75, inside an "é"
    prepare([words, chars], tmp_path / "out", validation_fraction=0.25)
    held = bytes(load_tokens(tmp_path / "out" / "validation").astype(np.uint8))
    assert held == b"six" + "é".encode() * 12


def test_the_search_for_a_line_start_is_bounded(tmp_path: Path, texts: list[Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prep, "CUT_SEARCH_BYTES", 2)  # a: bytes 82..84 are " li": after the " "
    prepare(texts[:1], tmp_path / "out", validation_fraction=0.25)
    assert bytes(load_tokens(tmp_path / "out" / "validation").astype(np.uint8)) == TEXT_A[83:]


def test_without_the_option_nothing_changes(tmp_path: Path, texts: list[Path]) -> None:
    meta = prepare(texts, tmp_path / "out")
    assert "validation" not in meta and not (tmp_path / "out" / "validation").exists()
    assert meta["num_tokens"] == len(TEXT_A + TEXT_B)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_bad_fractions(tmp_path: Path, texts: list[Path], fraction: float) -> None:
    with pytest.raises(InvalidInput, match=r"--validation-fraction must be between 0 and 1"):
        prepare(texts, tmp_path / "out", validation_fraction=fraction)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_a_split_that_holds_out_nothing(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_bytes(b"hello\nworld\n")  # 12 - floor(1.2) = 11, moved to the end: nothing
    with pytest.raises(InvalidInput, match=r"--validation-fraction 0.1 leaves no validation"):
        prepare([short], tmp_path / "out", validation_fraction=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_a_tail_without_tokens_fails_after_encoding_and_leaves_nothing(
        tmp_path: Path, texts: list[Path], tokenizer_json: Path) -> None:
    blank = tmp_path / "blank.txt"
    blank.write_bytes(b"alpha line\n" * 9 + b"    \n   \n")  # the tail is whitespace only
    with pytest.raises(InvalidInput, match=r"leaves no validation text"):
        prepare([blank], tmp_path / "out", tokenizer=tokenizer_json, eos="</s>",
                validation_fraction=0.05)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a.txt", "b.txt", "blank.txt", "tokenizer.json"]
