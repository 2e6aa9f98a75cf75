"""Turn text files into a token-shard directory: byte-level, or any Hugging Face tokenizer.json.

The output is what :class:`xffl.training.data.TokenShards` reads (``train.bin`` + ``meta.json``,
as nanoGPT and Megatron keep them): uint16 tokens when the vocabulary fits, uint32 otherwise.
Text is read and encoded in pieces cut at line ends (a few MiB each, so memory does not grow
with the corpus), written to a staging directory, and renamed into place when complete;
``meta.json`` records the tokenizer (a copy of it sits beside the shards) and the sha256 of
every source file, so a site can tell later what its data was made from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from xffl.aggregator.exchange import staged_dir
from xffl.core.errors import InvalidInput
from xffl.training.data import META_FILE, TOKENS_FILE

PIECE_BYTES = 4 << 20
TOKENIZER_FILE = "tokenizer.json"


def _pieces(fh: BinaryIO, size: int = PIECE_BYTES) -> Iterator[bytes]:
    """Consecutive pieces of a stream, cut after a newline (else a space) where there is one."""
    rest = b""
    while chunk := fh.read(size):
        data = rest + chunk
        cut = data.rfind(b"\n") + 1 or data.rfind(b" ") + 1
        if cut == 0:
            if len(data) < 4 * size:  # no line end or space yet: read on, within bounds
                rest = data
                continue
            cut = len(data)
        rest = data[cut:]
        yield data[:cut]
    if rest:
        yield rest


class _Encoder:
    """Bytes of text -> token ids, by bytes or with a tokenizers.Tokenizer."""

    def __init__(self, tokenizer: Path | None, eos: str | None) -> None:
        self.tokenizer = None
        self.eos_id: int | None = None
        if tokenizer is None:
            self.vocab_size = 256
            if eos is not None:
                raise InvalidInput("--eos needs --tokenizer (byte-level data has no special "
                                   "tokens); drop --eos or pass a tokenizer.json.")
            return
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - a dependency of xffl
            raise InvalidInput("the tokenizers package is missing; pip install tokenizers.") \
                from exc
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise InvalidInput(f"{tokenizer}: not a Hugging Face tokenizer.json ({exc}); "
                               "pass the tokenizer.json of a tokenizers/transformers model.") \
                from exc
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if eos is not None:
            self.eos_id = self.tokenizer.token_to_id(eos)
            if self.eos_id is None:
                raise InvalidInput(f"{tokenizer}: no token {eos!r} for --eos; use one of the "
                                   "tokenizer's special tokens.")

    def encode(self, piece: bytes) -> np.ndarray:
        """Token ids of one piece of text."""
        if self.tokenizer is None:
            return np.frombuffer(piece, dtype=np.uint8)
        text = piece.decode("utf-8", errors="replace")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids,
                          dtype=np.int64)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def prepare(inputs: Sequence[Path], out: Path, *, tokenizer: Path | None = None,
            eos: str | None = None, force: bool = False) -> dict[str, Any]:
    """Tokenize ``inputs`` (in order) into the token-shard directory ``out``; return its meta.

    With ``eos`` (a tokenizer's special token) that token follows every input file.
    ``out`` must not hold a dataset unless ``force``; it appears only when complete.
    """
    out = Path(out)
    if not inputs:
        raise InvalidInput("no input text files; name one or more .txt files.")
    for src in inputs:
        if not Path(src).is_file():
            raise InvalidInput(f"{src}: no such file; name existing text files.")
    if out.exists() and any(out.iterdir()) and not force:
        raise InvalidInput(f"{out} is not empty; choose a new directory or pass --force.")
    encoder = _Encoder(tokenizer, eos)
    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    sources: list[dict[str, Any]] = []
    num_tokens = 0
    with staged_dir(out) as tmp:
        with (tmp / TOKENS_FILE).open("wb") as sink:
            for src in map(Path, inputs):
                count = 0
                with src.open("rb") as fh:
                    for piece in _pieces(fh):
                        ids = encoder.encode(piece)
                        sink.write(ids.astype(dtype).tobytes())
                        count += len(ids)
                if encoder.eos_id is not None:
                    sink.write(np.asarray([encoder.eos_id], dtype=dtype).tobytes())
                    count += 1
                num_tokens += count
                sources.append({"path": str(src.resolve()), "bytes": src.stat().st_size,
                                "sha256": _sha256(src), "tokens": count})
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        meta: dict[str, Any] = {
            "dtype": np.dtype(dtype).name,
            "num_tokens": num_tokens,
            "vocab_size": encoder.vocab_size,
            "tokenizer": "bytes" if tokenizer is None else {
                "file": TOKENIZER_FILE, "sha256": _sha256(Path(tokenizer)), "eos": eos},
            "sources": sources,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
