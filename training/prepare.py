"""Turn text files into a token-shard directory: byte-level, or any Hugging Face tokenizer.json.

The output is what :class:`xffl.training.data.TokenShards` reads (``train.bin`` + ``meta.json``,
as nanoGPT and Megatron keep them): uint16 tokens when the vocabulary fits, uint32 otherwise.
Text is read and encoded in pieces cut at line ends (a few MiB each, so memory does not grow
with the corpus), written to a staging directory, and renamed into place when complete;
``meta.json`` records the tokenizer (a copy of it sits beside the shards) and the sha256 of
every source file, so a site can tell later what its data was made from.

With ``validation_fraction`` F the last F of every input file (cut at a line start) is held
out into ``validation/``, a second token-shard directory of the same format inside the first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
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
VALIDATION_DIR = "validation"
CUT_SEARCH_BYTES = 1 << 20  # how far a validation cut may move to reach a line start


def _reads(fh: BinaryIO, size: int, end: int | None) -> Iterator[bytes]:
    """Reads of at most ``size`` bytes from ``fh``, up to offset ``end`` (None: the end)."""
    while True:
        n = size if end is None else min(size, end - fh.tell())
        if n <= 0 or not (chunk := fh.read(n)):
            return
        yield chunk


def _pieces(fh: BinaryIO, size: int | None = None, end: int | None = None) -> Iterator[bytes]:
    """Consecutive pieces of a stream, cut after a newline (else a space) where there is one."""
    size = size or PIECE_BYTES
    rest = b""
    for chunk in _reads(fh, size, end):
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


def _cut(path: Path, fraction: float) -> int:
    """Offset of the held-out tail of ``path``: its last ``fraction``, moved to a line start.

    The offset ``size - floor(size * fraction)`` moves forward to the first line start at or
    after it (else the first word start, else character start) within CUT_SEARCH_BYTES.
    """
    size = path.stat().st_size
    cut = size - math.floor(size * fraction)
    if cut in (0, size):
        return cut
    with path.open("rb") as fh:
        fh.seek(cut - 1)
        window = fh.read(CUT_SEARCH_BYTES + 1)  # window[i] is byte cut - 1 + i
    for sep in (b"\n", b" "):
        if (at := window.find(sep)) >= 0:
            return cut + at
    at = 1
    while at < len(window) and window[at] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        at += 1
    return cut - 1 + at


class _Shards:
    """A token-shard directory being written: its token stream and what went into it."""

    def __init__(self, directory: Path, encoder: _Encoder, dtype: type[np.unsignedinteger[Any]],
                 ) -> None:
        directory.mkdir(exist_ok=True)
        self.directory, self.encoder, self.dtype = directory, encoder, dtype
        self.sink = (directory / TOKENS_FILE).open("wb")
        self.num_tokens = 0
        self.text_tokens = 0  # without the eos tokens
        self.sources: list[dict[str, Any]] = []

    def add(self, src: Path, start: int, end: int) -> int:
        """Encode bytes [start, end) of ``src``, then the eos token if any; return the count."""
        count = 0
        with src.open("rb") as fh:
            fh.seek(start)
            for piece in _pieces(fh, end=end):
                ids = self.encoder.encode(piece)
                self.sink.write(ids.astype(self.dtype).tobytes())
                count += len(ids)
        self.text_tokens += count
        if self.encoder.eos_id is not None:
            self.sink.write(np.asarray([self.encoder.eos_id], dtype=self.dtype).tobytes())
            count += 1
        self.num_tokens += count
        return count

    def finish(self, tokenizer: Path | None, eos: str | None,
               extra: dict[str, Any]) -> dict[str, Any]:
        """Close the stream, copy the tokenizer, write meta.json (``extra`` last); return it."""
        self.sink.close()
        if tokenizer is not None:
            shutil.copyfile(tokenizer, self.directory / TOKENIZER_FILE)
        meta: dict[str, Any] = {
            "dtype": np.dtype(self.dtype).name,
            "num_tokens": self.num_tokens,
            "vocab_size": self.encoder.vocab_size,
            "tokenizer": "bytes" if tokenizer is None else {
                "file": TOKENIZER_FILE, "sha256": _sha256(Path(tokenizer)), "eos": eos},
            "sources": self.sources,
            **extra,
        }
        (self.directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return meta


def _fsync_files(directory: Path) -> None:
    """Flush the files of ``directory`` to disk (staged_dir syncs only the top level)."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_inputs(inputs: Sequence[Path], out: Path, force: bool,
                 fraction: float | None) -> None:
    """InvalidInput unless the inputs exist, ``out`` may be written and the fraction is sane."""
    if not inputs:
        raise InvalidInput("no inputs; name one or more files to prepare.")
    for src in inputs:
        if not src.exists():
            raise InvalidInput(f"{src}: no such file or folder; name existing inputs.")
    if fraction is not None and not 0 < fraction < 1:
        raise InvalidInput(f"--validation-fraction must be between 0 and 1 (got {fraction}); "
                           "pass e.g. 0.05 to hold out 5%.")
    if out.exists() and any(out.iterdir()) and not force:
        raise InvalidInput(f"{out} is not empty; choose a new directory or pass --force.")


def _check_split(fraction: float, train: int, validation: int) -> None:
    """InvalidInput when the split leaves the training or the validation side empty."""
    for side, amount in (("training", train), ("validation", validation)):
        if amount == 0:
            raise InvalidInput(f"--validation-fraction {fraction} leaves no {side} text; "
                               "choose a fraction that leaves text on both sides.")


def prepare(inputs: Sequence[Path], out: Path, *, tokenizer: Path | None = None,
            eos: str | None = None, force: bool = False,
            validation_fraction: float | None = None) -> dict[str, Any]:
    """Tokenize ``inputs`` (in order) into the token-shard directory ``out``; return its meta.

    With ``eos`` (a tokenizer's special token) that token follows every input file (and every
    held-out tail). With ``validation_fraction`` the tail of each file past :func:`_cut` goes
    to ``out/validation``. ``out`` must not hold a dataset unless ``force``; it appears only
    when complete.
    """
    out, srcs, fraction = Path(out), [Path(s) for s in inputs], validation_fraction
    check_inputs(srcs, out, force, fraction)
    for src in srcs:
        if not src.is_file():
            raise InvalidInput(f"{src} is a folder; name the text files in it.")
    encoder = _Encoder(tokenizer, eos)
    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    sizes = [src.stat().st_size for src in srcs]
    cuts = sizes if fraction is None else [_cut(src, fraction) for src in srcs]
    if fraction is not None:
        _check_split(fraction, sum(cuts), sum(sizes) - sum(cuts))
    with staged_dir(out) as tmp:
        train = _Shards(tmp, encoder, dtype)
        held = None if fraction is None else _Shards(tmp / VALIDATION_DIR, encoder, dtype)
        for src, size, cut in zip(srcs, sizes, cuts, strict=True):
            entry = {"path": str(src.resolve()), "bytes": size, "sha256": _sha256(src)}
            train.sources.append({**entry, "tokens": train.add(src, 0, cut)})
            if held is not None:
                held.sources.append({**entry, "offset": cut,
                                     "tokens": held.add(src, cut, size) if cut < size else 0})
        extra: dict[str, Any] = {}
        if held is not None and fraction is not None:
            _check_split(fraction, train.text_tokens, held.text_tokens)
            held.finish(tokenizer, eos, {"split": "validation"})
            _fsync_files(held.directory)
            extra["validation"] = {"fraction": fraction, "num_tokens": held.num_tokens,
                                   "path": VALIDATION_DIR}
        meta = train.finish(tokenizer, eos, extra)
    return meta
