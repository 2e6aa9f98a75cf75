"""Token shards with a loss mask from structured examples: tokenized, packed or padded, split.

Each example (:mod:`xffl.training.sources`) is rendered into segments (:mod:`xffl.training.
render`), its whole text tokenized once, and each token marked in ``flags.bin`` (one uint8 a
token, beside ``train.bin``): bit 0 (LOSS) when the token is a target of the loss, i.e. its
first character (as the tokenizer's offsets give it) lies in a segment in the loss; bit 1
(START) on an example's first token, which is never in the loss (nothing of its example
comes before it). Packed (the default), the examples follow each other in the stream and the
trainer restarts the position ids at every START, which makes transformers' attention keep
each example to itself (:func:`xffl.training.data.positions`); padded, each example is one
window of ``seq_len + 1`` tokens, cut there if longer, filled with the pad token out of the
loss.

With ``validation_fraction`` F every example is held out with probability F, by draws from a
generator seeded by ``seed`` (the same examples for the same input and seed), into
``validation/``, a token-shard directory of the same format.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.exchange import staged_dir
from xffl.core.errors import InvalidInput
from xffl.training.bad_examples import BadExamples
from xffl.training.data import FLAGS_FILE, LOSS, META_FILE, START, TOKENS_FILE
from xffl.training.render import Fields, Format, Renderer, Segment, TrainOn
from xffl.training.sources import BadExample, Record, examples

BATCH = 256  # examples tokenized together (the tokenizer's batch runs on all cores)
VALIDATION_DIR = "validation"
SPLIT_SALT = int.from_bytes(hashlib.sha256(b"xffl-example-split").digest()[:8], "big")


class Encoder:
    """Text -> token ids and each token's first character: bytes, a tokenizer.json, or a
    model folder's transformers tokenizer (whose chat template renders conversations)."""

    def __init__(self, path: Path | None, eos: str | None) -> None:
        self.backend: Any = None
        self.template: Any = None
        self.saved: Any = None
        self.pad_id, self.eos_text = 0, eos or ""
        if path is None:
            self.vocab_size = 256
            if eos is not None:
                raise InvalidInput("--eos needs --tokenizer (byte-level data has no special "
                                   "tokens); drop --eos or pass a tokenizer.")
            return
        if Path(path).is_dir():
            self._folder(Path(path))
        else:
            from tokenizers import Tokenizer

            try:
                self.backend = Tokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises its own Exception subclass
                raise InvalidInput(f"{path}: not a Hugging Face tokenizer.json ({exc}); pass a "
                                   "tokenizer.json or a model folder.") from exc
            self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        if eos is not None and self.backend.token_to_id(eos) is None:
            raise InvalidInput(f"{path}: no token {eos!r} for --eos; use one of the "
                               "tokenizer's special tokens.")

    def _folder(self, path: Path) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, ...
            raise InvalidInput(f"{path}: no tokenizer transformers can load ({exc}); pass a "
                               "model folder with tokenizer.json.") from exc
        self.backend = getattr(tok, "backend_tokenizer", None)
        if self.backend is None:
            raise InvalidInput(f"{path}: a slow (Python) tokenizer; xffl needs its "
                               "tokenizer.json (a fast tokenizer).")
        self.saved, self.vocab_size = tok, len(tok)
        self.template = tok if getattr(tok, "chat_template", None) else None
        self.eos_text = self.eos_text or (tok.eos_token or "")
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad or 0)

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(token ids, index of each token's first character) of every text."""
        if self.backend is None:
            out = []
            for text in texts:
                raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
                # a character starts at every byte that is not a UTF-8 continuation byte
                starts = np.cumsum((raw & 0xC0) != 0x80) - 1
                out.append((raw.astype(np.int64), starts))
            return out
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        return [(np.asarray(e.ids, dtype=np.int64),
                 np.asarray([o[0] for o in e.offsets], dtype=np.int64)) for e in encodings]

    def describe(self, directory: Path, path: Path | None) -> Any:
        """Copy the tokenizer into ``directory``; what meta.json records of it."""
        if path is None:
            return "bytes"
        if self.saved is not None:
            self.saved.save_pretrained(str(directory / "tokenizer"))
            return {"dir": "tokenizer", "chat_template": self.template is not None,
                    "eos": self.eos_text or None}
        shutil.copyfile(path, directory / "tokenizer.json")
        return {"file": "tokenizer.json", "eos": self.eos_text or None}


def token_flags(segments: list[tuple[str, bool]], starts: np.ndarray) -> np.ndarray:
    """LOSS/START flags of an example's tokens from its segments and token start characters."""
    ends = np.cumsum([len(text) for text, _ in segments])
    supervised = np.asarray([s for _, s in segments], dtype=bool)
    where = np.minimum(np.searchsorted(ends, starts, side="right"), len(segments) - 1)
    flags = np.where(supervised[where], LOSS, 0).astype(np.uint8)
    if len(flags):
        flags[0] = START
    return flags


@dataclass
class Layout:
    """How examples become windows: packed in one stream, or each padded to seq_len + 1."""

    pad_to: int | None = None  # seq_len + 1 when padded
    pad_id: int = 0


class _Sink:
    """A token-shard directory being written: tokens, flags, and their counts."""

    def __init__(self, directory: Path, dtype: type[np.unsignedinteger[Any]],
                 layout: Layout) -> None:
        directory.mkdir(exist_ok=True)
        self.directory, self.dtype, self.layout = directory, dtype, layout
        self.tokens = (directory / TOKENS_FILE).open("wb")
        self.flags = (directory / FLAGS_FILE).open("wb")
        self.num_tokens = self.loss_tokens = self.examples = self.truncated = 0

    def add(self, examples: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Append examples, (ids, flags) each (cut or padded to the window when padded), in
        one write of each file."""
        if not examples:
            return
        width = self.layout.pad_to
        if width is not None:
            padded = []
            for ids, flags in examples:
                if len(ids) > width:
                    ids, flags, self.truncated = ids[:width], flags[:width], self.truncated + 1
                fill = width - len(ids)
                padded.append((np.concatenate([ids, np.full(fill, self.layout.pad_id)]),
                               np.concatenate([flags, np.zeros(fill, dtype=np.uint8)])))
            examples = padded
        ids = np.concatenate([e[0] for e in examples])
        flags = np.concatenate([e[1] for e in examples])
        self.tokens.write(ids.astype(self.dtype).tobytes())
        self.flags.write(flags.tobytes())
        self.num_tokens += len(ids)
        self.loss_tokens += int(np.count_nonzero(flags & LOSS))
        self.examples += len(examples)

    def finish(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Close the files and write meta.json with the counts; return it."""
        self.tokens.close()
        self.flags.close()
        meta = {"dtype": np.dtype(self.dtype).name, "num_tokens": self.num_tokens,
                "flags": FLAGS_FILE, "loss_tokens": self.loss_tokens,
                "examples": self.examples, "truncated": self.truncated, **meta}
        (self.directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return meta


def _batches(src: Path, bad: BadExamples) -> Iterator[list[tuple[str, Record]]]:
    """The input's examples in batches of :data:`BATCH`, its bad ones handed to ``bad``."""
    batch: list[tuple[str, Record]] = []
    for where, record in examples(src):
        if isinstance(record, BadExample):
            bad.add(record)
            continue
        batch.append((where, record))
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _rendered(renderer: Renderer, src: Path, batch: list[tuple[str, Record]],
              bad: BadExamples) -> list[list[Segment]]:
    """The segments of the batch's examples that render, its bad ones handed to ``bad``."""
    out = []
    for where, record in batch:
        try:
            out.append(renderer.segments(str(src), where, record))
        except BadExample as exc:
            bad.add(exc)
    return out


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None  # a datasets folder: datasets fingerprints it
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Options:
    """What `xffl data prepare` was asked for beyond the inputs and the tokenizer."""

    fmt: Format = "text"
    fields: Fields = field(default_factory=Fields)
    train_on: TrainOn = "response"
    seq_len: int | None = None  # padded to seq_len + 1 tokens a window when set
    validation_fraction: float | None = None
    seed: int = 0
    max_bad: int | None = None  # bad examples skipped and counted (None: stop at the first)


def prepare_examples(inputs: Sequence[Path], out: Path, tokenizer: Path | None,
                     eos: str | None, options: Options,
                     on_skip: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokenize the examples of ``inputs`` into the token-shard directory ``out``; its meta.

    ``out`` appears only when complete (written in a staging folder, renamed into place).
    Up to ``options.max_bad`` bad examples are left out, each told to ``on_skip``.
    """
    encoder = Encoder(tokenizer, eos)
    renderer = Renderer(options.fmt, options.fields, options.train_on, encoder.template,
                        encoder.eos_text)
    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    layout = Layout(None if options.seq_len is None else options.seq_len + 1, encoder.pad_id)
    fraction = options.validation_fraction
    rng = np.random.default_rng([SPLIT_SALT, options.seed])
    bad = BadExamples(options.max_bad or 0, on_skip)
    with staged_dir(out) as tmp:
        train = _Sink(tmp, dtype, layout)
        held = None if fraction is None else _Sink(tmp / VALIDATION_DIR, dtype, layout)
        sources = []
        for src in inputs:
            count, bad_before = 0, bad.count
            for batch in _batches(src, bad):
                segments = _rendered(renderer, src, batch, bad)
                encoded = encoder.encode(["".join(t for t, _ in segs) for segs in segments])
                done = [(ids, token_flags(segs, starts))
                        for segs, (ids, starts) in zip(segments, encoded, strict=True)]
                if held is None or fraction is None:
                    train.add(done)
                else:
                    drawn = (rng.random(len(done)) < fraction).tolist()
                    train.add([d for d, h in zip(done, drawn, strict=True) if not h])
                    held.add([d for d, h in zip(done, drawn, strict=True) if h])
                count += len(done)
            if count == 0 and bad.count > bad_before:
                raise InvalidInput(f"{src}: every example of it is bad ({bad.count - bad_before} "
                                   "skipped); fix the file, or the --format and field options.")
            if count == 0:
                raise InvalidInput(f"{src}: no example in it (an empty input); name inputs "
                                   "that hold examples.")
            sources.append({"path": str(src.resolve()), "sha256": _sha256(src),
                            "examples": count})
        common = {"vocab_size": encoder.vocab_size, "format": options.fmt,
                  "train_on": options.train_on,
                  "layout": "packed" if options.seq_len is None else "padded",
                  **({} if options.seq_len is None else {"seq_len": options.seq_len})}
        extra: dict[str, Any] = {}
        if held is not None:
            for side, sink in (("training", train), ("validation", held)):
                if sink.loss_tokens == 0:
                    raise InvalidInput(f"--validation-fraction {fraction} leaves no {side} "
                                       "example with tokens in the loss; choose a fraction "
                                       "that leaves examples on both sides.")
            vmeta = held.finish({**common, "tokenizer": encoder.describe(held.directory,
                                                                         tokenizer),
                                 "split": "validation", "sources": sources})
            extra["validation"] = {"fraction": fraction, "seed": options.seed,
                                   "num_tokens": vmeta["num_tokens"],
                                   "loss_tokens": vmeta["loss_tokens"],
                                   "examples": vmeta["examples"], "path": VALIDATION_DIR}
        if options.max_bad is not None:
            extra["skipped"] = bad.meta()
        meta = train.finish({**common, "tokenizer": encoder.describe(tmp, tokenizer),
                             "sources": sources, **extra})
    return meta
