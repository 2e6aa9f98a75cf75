"""Token shards on a site's filesystem, synthetic corpora, and the data-parallel sampler.

A dataset directory holds ``train.bin`` (the token stream, uint16 as nanoGPT keeps it) and
``meta.json`` (``{"dtype": "uint16", "num_tokens": N, "vocab_size": 256, "tokenizer":
"bytes"}``). Training sequences are the non-overlapping windows of ``seq_len + 1`` tokens;
each epoch they are permuted from (seed, round, epoch) and dealt disjointly to the dp ranks.
A site's held-out windows (``data.validation.fraction``, :func:`validation_indices`) are a
fixed set, the same every round and run, that the training sampler never deals.

Instruction and chat data (:mod:`xffl.training.prepare_examples`) add ``flags.bin``, one
uint8 a token (meta.json's ``"flags"``): LOSS marks a token that is a target of the loss,
START an example's first token. A batch's targets are then IGNORE where the target token is
not in the loss (the loss and the counts skip them), and its position ids restart at every
START (:meth:`TokenShards.positions`). A directory without flags (text) trains on every token,
as before.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from xffl.core.errors import InvalidInput
from xffl.core.files import atomic_write
from xffl.training.config import DataSpec

TOKENS_FILE = "train.bin"
META_FILE = "meta.json"
FLAGS_FILE = "flags.bin"
LOSS, START = 1, 2  # bits of flags.bin: the token is a target of the loss; an example starts
IGNORE = -100  # a target the loss skips (torch's cross_entropy ignore_index default)
GENERATOR_VERSION = 1
_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class Language:
    """Parameters of a synthetic "language": a made-up lexicon and a word-level Markov chain."""

    consonants: str
    vowels: str
    syllable: str  # pattern over C and V, e.g. "CV" or "CVC"
    syllables: tuple[int, int]  # min, max syllables per word
    lexicon: int  # number of distinct words
    zipf: float  # exponent of the rank-frequency law (start words and successors)
    branching: int  # successors each word may be followed by
    sentence: tuple[int, int]  # min, max words per sentence
    separator: str
    terminator: str
    capitalize: bool


LANGUAGES: dict[str, Language] = {
    "alpha": Language("bdfgklmnprst", "aeiou", "CV", (1, 3), 120, 1.1, 6, (4, 10), " ",
                      ".\n", True),
    "beta": Language("hjkqvwxyz", "aeuy", "CVC", (1, 2), 300, 0.7, 16, (3, 7), "-",
                     "!\n", False),
    "gamma": Language("ctrsmn", "ao", "VCC", (1, 3), 80, 1.4, 4, (6, 14), " ",
                      ";\n", False),
    "delta": Language("lmnrvw", "aeiouy", "VCV", (1, 2), 200, 0.9, 10, (2, 6), ", ",
                      "?\n", True),
}


def _language_seed(name: str) -> int:
    """A seed derived from the language name (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.sha256(f"xffl-synthetic:{name}".encode()).digest()[:8], "big")


def _zipf_cumulative(n: int, exponent: float) -> list[float]:
    weights = [1.0 / (rank**exponent) for rank in range(1, n + 1)]
    total = sum(weights)
    acc, out = 0.0, []
    for w in weights:
        acc += w / total
        out.append(acc)
    out[-1] = 1.0
    return out


def _make_lexicon(lang: Language, rng: random.Random) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(words) < lang.lexicon:
        attempts += 1
        if attempts > 1000 * lang.lexicon:
            raise RuntimeError("synthetic lexicon too small for its alphabet")
        n = lang.syllables[0] + int(rng.random() * (lang.syllables[1] - lang.syllables[0] + 1))
        word = "".join(
            (lang.consonants if c == "C" else lang.vowels)[
                int(rng.random() * len(lang.consonants if c == "C" else lang.vowels))
            ]
            for _ in range(n)
            for c in lang.syllable
        )
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def synthetic_text(language: str, num_bytes: int) -> bytes:
    """Exactly ``num_bytes`` bytes of a synthetic language, a pure function of its name."""
    if language not in LANGUAGES:
        raise InvalidInput(
            f"unknown synthetic language {language!r}; known: {', '.join(LANGUAGES)}"
        )
    lang = LANGUAGES[language]
    rng = random.Random(_language_seed(language))
    words = _make_lexicon(lang, rng)
    start_cum = _zipf_cumulative(len(words), lang.zipf)
    succ_cum = _zipf_cumulative(lang.branching, lang.zipf)
    successors = [
        [int(rng.random() * len(words)) for _ in range(lang.branching)] for _ in words
    ]
    out: list[str] = []
    size = 0
    while size < num_bytes:
        length = lang.sentence[0] + int(rng.random() * (lang.sentence[1] - lang.sentence[0] + 1))
        w = bisect.bisect_left(start_cum, rng.random())
        sentence = [words[w]]
        for _ in range(length - 1):
            w = successors[w][bisect.bisect_left(succ_cum, rng.random())]
            sentence.append(words[w])
        text = lang.separator.join(sentence) + lang.terminator
        if lang.capitalize:
            text = text[0].upper() + text[1:]
        out.append(text)
        size += len(text)
    return "".join(out).encode("ascii")[:num_bytes]


def read_meta(path: Path) -> dict[str, Any]:
    """The dataset's meta.json; InvalidInput when it is missing or malformed."""
    meta_path = Path(path) / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError as exc:
        if not Path(path).is_dir():
            raise InvalidInput(f"{path}: no such folder; prepare the data there (`xffl data "
                               "prepare`) or fix data.path (a relative one is read under the "
                               "site profile's workdir).") from exc
        raise InvalidInput(f"{path}: no {META_FILE}; is this a token-shard directory?") from exc
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{meta_path}: unreadable ({exc}).") from exc
    if not isinstance(meta, dict) or meta.get("dtype") not in _DTYPES:
        raise InvalidInput(f"{meta_path}: dtype must be one of {', '.join(_DTYPES)}.")
    if not isinstance(meta.get("num_tokens"), int) or meta["num_tokens"] < 0:
        raise InvalidInput(f"{meta_path}: num_tokens must be a non-negative integer.")
    return meta


def ensure_synthetic(path: Path, language: str, num_sequences: int, seq_len: int) -> Path:
    """Generate a synthetic byte-level corpus at ``path`` unless the same one is already there.

    Writes train.bin then meta.json, each to a unique temporary name renamed into place, so
    concurrent callers (ranks, nodes) are safe: they write identical bytes and a reader only
    trusts train.bin once meta.json exists. A directory holding a non-synthetic dataset is
    never overwritten.
    """
    path = Path(path)
    num_tokens = num_sequences * (seq_len + 1)
    wanted = {"language": language, "num_sequences": num_sequences, "seq_len": seq_len,
              "generator_version": GENERATOR_VERSION}
    if (path / META_FILE).exists():
        meta = read_meta(path)
        if "synthetic" not in meta:
            raise InvalidInput(
                f"{path} holds a dataset that was not generated by xffl; refusing to overwrite "
                "it with synthetic data (unset data.synthetic or choose another data.path)."
            )
        size_ok = (path / TOKENS_FILE).is_file() and (path / TOKENS_FILE).stat().st_size == (
            meta["num_tokens"] * np.dtype(_DTYPES[meta["dtype"]]).itemsize
        )
        if meta["synthetic"] == wanted and size_ok:
            return path
    path.mkdir(parents=True, exist_ok=True)
    tokens = np.frombuffer(synthetic_text(language, num_tokens), dtype=np.uint8)
    atomic_write(path / TOKENS_FILE, tokens.astype(np.uint16).tobytes())
    meta = {"dtype": "uint16", "num_tokens": num_tokens, "vocab_size": 256,
            "tokenizer": "bytes", "synthetic": wanted}
    atomic_write(path / META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    return path


def load_tokens(path: Path) -> np.ndarray:
    """The token stream of a dataset directory as a read-only memmap (validated against meta)."""
    path = Path(path)
    meta = read_meta(path)
    dtype = np.dtype(_DTYPES[meta["dtype"]])
    tokens_path = path / TOKENS_FILE
    expected = meta["num_tokens"] * dtype.itemsize
    try:
        actual = tokens_path.stat().st_size
    except FileNotFoundError as exc:
        raise InvalidInput(f"{path}: no {TOKENS_FILE}.") from exc
    if actual != expected:
        raise InvalidInput(
            f"{tokens_path}: {actual} bytes, meta.json promises {meta['num_tokens']} "
            f"{meta['dtype']} tokens ({expected} bytes)."
        )
    if meta["num_tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(tokens_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))


def load_flags(path: Path, num_tokens: int) -> np.ndarray | None:
    """The LOSS/START flags of a dataset directory as a read-only memmap; None without."""
    meta = read_meta(Path(path))
    if "flags" not in meta:
        return None
    flags_path = Path(path) / FLAGS_FILE
    if meta["flags"] != FLAGS_FILE or not flags_path.is_file() \
            or flags_path.stat().st_size != num_tokens:
        raise InvalidInput(f"{flags_path}: meta.json promises {num_tokens} flags (one byte a "
                           "token); prepare the data again.")
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(flags_path, dtype=np.uint8, mode="r", shape=(num_tokens,))


def positions(starts: np.ndarray) -> np.ndarray:
    """Position ids of rows whose examples begin where ``starts`` is true: each position
    counts from the last start at or before it (from the row's first token if none)."""
    index = np.broadcast_to(np.arange(starts.shape[1]), starts.shape)
    last = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last


def num_samples(path: Path, seq_len: int) -> int:
    """Number of training sequences (windows of seq_len + 1 tokens) at the site."""
    return int(read_meta(Path(path))["num_tokens"]) // (seq_len + 1)


# the held-out split depends on nothing but the number of windows and the fraction, so the
# same windows are held out in every round, run and job that reads the data this way
_VALIDATION_SALT = int.from_bytes(hashlib.sha256(b"xffl-validation").digest()[:8], "big")


def held_out_count(n: int, fraction: float) -> int:
    """How many of ``n`` windows a fraction holds out: ceil(fraction x n), at least one."""
    k = max(1, math.ceil(round(fraction * n, 9)))  # 0.1 x 770 is 77.00000000000001 in floats
    if k >= n:
        raise InvalidInput(f"data.validation.fraction {fraction} of {n} sequence(s) leaves "
                           "nothing to train on; use more data or a smaller fraction.")
    return k


def validation_indices(n: int, fraction: float) -> np.ndarray:
    """The windows held out for validation, ascending: the first ceil(f n) of a fixed
    permutation of all n (seeded by a constant and n)."""
    order = np.random.default_rng([_VALIDATION_SALT, n]).permutation(n)
    return np.sort(order[:held_out_count(n, fraction)])


def training_indices(n: int, fraction: float | None) -> np.ndarray:
    """The windows the sampler may deal, ascending: all but the held-out ones."""
    keep = np.ones(n, dtype=bool)
    if fraction is not None:
        keep[validation_indices(n, fraction)] = False
    return np.flatnonzero(keep)


def epoch_permutation(n: int, seed: int, round: int, epoch: int) -> np.ndarray:
    """The order of all n sequences in one epoch, a pure function of (seed, round, epoch)."""
    return np.random.default_rng([seed, round, epoch]).permutation(n)


def rank_indices(n: int, dp_rank: int, dp_size: int, seed: int, round: int,
                 epoch: int) -> np.ndarray:
    """The sequences dp rank ``dp_rank`` trains on in one epoch: disjoint, n // dp_size each."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
    per_rank = n // dp_size
    return epoch_permutation(n, seed, round, epoch)[dp_rank::dp_size][:per_rank]


def index_batches(n: int, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                  round: int) -> Iterator[np.ndarray]:
    """Endless batches of sequence indices for one rank; epochs follow each other seamlessly."""
    if n // dp_size < 1:
        raise InvalidInput(
            f"the dataset has {n} sequences, fewer than the {dp_size} data-parallel ranks."
        )
    pending = np.zeros(0, dtype=np.int64)
    epoch = 0
    while True:
        while len(pending) < batch_size:
            fresh = rank_indices(n, dp_rank, dp_size, seed, round, epoch)
            pending = np.concatenate([pending, fresh.astype(np.int64)])
            epoch += 1
        yield pending[:batch_size]
        pending = pending[batch_size:]


class TokenShards:
    """Fixed-length sequences cut from a dataset directory's token stream.

    ``windows`` (ascending window numbers) restricts them to a subset: sequence ``i`` is then
    window ``windows[i]`` (the training or the held-out part of a split dataset).
    """

    def __init__(self, path: Path, seq_len: int, windows: np.ndarray | None = None) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.tokens = load_tokens(self.path)
        self.flags = load_flags(self.path, len(self.tokens))
        meta = read_meta(self.path)
        self.vocab_size = int(meta.get("vocab_size", 256))
        if meta.get("layout") == "padded" and meta.get("seq_len") != seq_len:
            raise InvalidInput(f"{self.path}: examples padded to seq_len {meta.get('seq_len')}"
                               f", the job's training.seq_len is {seq_len}; make them agree.")
        self.num_windows = len(self.tokens) // (seq_len + 1)
        self.windows = windows
        self.num_sequences = self.num_windows if windows is None else len(windows)

    def __len__(self) -> int:
        """Number of sequences."""
        return self.num_sequences

    def window(self, indices: np.ndarray) -> np.ndarray:
        """The window numbers of sequences ``indices`` in the token stream."""
        return np.asarray(indices) if self.windows is None else self.windows[indices]

    def _rows(self, data: np.ndarray, indices: np.ndarray) -> np.ndarray:
        width = self.seq_len + 1
        return np.stack([np.asarray(data[i * width:(i + 1) * width])
                         for i in self.window(indices)])

    def batch(self, indices: np.ndarray) -> tuple[Tensor, Tensor]:
        """(inputs, targets) int64 tensors of shape (len(indices), seq_len); a target out of
        the loss (flags without LOSS) is IGNORE."""
        data = torch.from_numpy(self._rows(self.tokens, indices).astype(np.int64))
        targets = data[:, 1:].contiguous()
        if self.flags is not None:
            keep = torch.from_numpy(self._rows(self.flags, indices)[:, 1:] & LOSS != 0)
            targets[~keep] = IGNORE
        return data[:, :-1].contiguous(), targets

    def positions(self, indices: np.ndarray) -> Tensor | None:
        """Position ids of the inputs of ``indices``, restarting at each example's first
        token; None when no example starts inside a row (the model's own 0..seq_len-1)."""
        if self.flags is None:
            return None
        starts = self._rows(self.flags, indices)[:, :-1] & START != 0
        if not starts[:, 1:].any():
            return None
        return torch.from_numpy(positions(starts).astype(np.int64))

    def batches(self, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                round: int, skip: int = 0) -> Iterator[tuple[Tensor, ...]]:
        """Endless (inputs, targets) batches for one dp rank (see index_batches), with the
        position ids as a third tensor when examples are packed in them; ``skip``: the first
        batches are left out (a round continued from a checkpoint: only their indices are
        drawn, no token is read)."""
        for idx in islice(index_batches(self.num_sequences, batch_size, dp_rank, dp_size, seed,
                                        round), skip, None):
            pos = self.positions(idx)
            yield self.batch(idx) if pos is None else (*self.batch(idx), pos)


def site_splits(data_dir: Path, data: DataSpec,
                seq_len: int) -> tuple[TokenShards, TokenShards | None]:
    """A site's training sequences and its held-out ones (None without data.validation).

    ``validation.fraction`` splits ``data_dir``'s windows (:func:`validation_indices`);
    ``validation.path`` is a dataset directory of its own, read whole.
    """
    validation = data.validation
    if validation is None:
        return TokenShards(data_dir, seq_len), None
    if validation.path is not None:
        return TokenShards(data_dir, seq_len), TokenShards(Path(validation.path), seq_len)
    assert validation.fraction is not None
    n = num_samples(data_dir, seq_len)
    return (TokenShards(data_dir, seq_len, training_indices(n, validation.fraction)),
            TokenShards(data_dir, seq_len, validation_indices(n, validation.fraction)))
