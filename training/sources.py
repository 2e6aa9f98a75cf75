"""A site's examples, streamed from JSON lines, JSON, Parquet, CSV or a ``datasets`` folder.

Each reader yields ``(where, record)`` pairs: ``where`` names the example for an error
message ("line 12", "row 7"), ``record`` is the example's fields as a dict, or the
:class:`BadExample` that says why that one example cannot be used (a JSON line that is not
JSON, an array element that is not an object): the reader goes on with the next one, and
the caller decides whether to stop or skip it. What spoils the rest of an input (a JSON
array cut short, an unreadable Parquet batch) stays an :class:`InvalidInput`. Nothing reads a
whole file: JSON lines go line by line, a JSON array element by element, Parquet and CSV in
record batches through pyarrow, and a folder written by ``datasets.Dataset.save_to_disk``
through datasets, which memory-maps its Arrow files. So memory stays flat in the input's size.
"""

from __future__ import annotations

import codecs
import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xffl.core.errors import InvalidInput

Record = dict[str, Any]


class BadExample(InvalidInput):
    """One example that cannot be used, named by file and line, element or row (and field);
    the input's other examples can."""


Item = tuple[str, Record | BadExample]  # where, and the example or why it is bad
BATCH_ROWS = 1024  # rows a pyarrow / datasets batch holds: a few MB of text
READ_BYTES = 1 << 20  # the read size of a JSON array
# a JSON decode error this close to the end of what was read may be the read's cut (a
# literal such as ``-Infinity`` or a ``\uXXXX`` escape split in two): read on; further in,
# the element is malformed whatever follows, and is refused without reading further
CUT_MARGIN = 16
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def kind(path: Path) -> str:
    """The reader a path needs: jsonl, json, parquet, csv or datasets (InvalidInput if none)."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "datasets"
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise InvalidInput(f"{path}: a DatasetDict of splits {', '.join(splits)}; name one "
                               f"split's folder, e.g. {path / (splits or ['train'])[0]}.")
        raise InvalidInput(f"{path}: a folder, but not one datasets' save_to_disk wrote (no "
                           "dataset_info.json); name a file or such a folder.")
    if not path.is_file():
        raise InvalidInput(f"{path}: no such file or folder; name existing inputs.")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InvalidInput(f"{path}: unknown input type {suffix or '(no suffix)'!r}; xffl "
                           "reads .txt, .jsonl, .json, .parquet, .csv and save_to_disk folders.")
    return suffix[1:]


def _object(path: Path, where: str, value: Any) -> Record | BadExample:
    if not isinstance(value, dict):
        return BadExample(f"{path}: {where}: a JSON {type(value).__name__}, not an object; "
                          "each example must be an object of fields.")
    return value


def _too_deep(path: Path, where: str) -> BadExample:
    """The refusal of a JSON value nested deeper than Python's parser recurses."""
    return BadExample(f"{path}: {where}: JSON nested too deep for Python's parser (about "
                        f"{sys.getrecursionlimit()} levels); flatten the example's fields.")


def _jsonl(path: Path) -> Iterator[Item]:
    """One example per non-blank line; a line that is not UTF-8 or not a JSON object is a
    bad example (the next line is read all the same)."""
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            where = f"line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadExample(f"{path}: {where}: not UTF-8 (byte {exc.start}); save "
                                        "the file as UTF-8.")
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                yield where, BadExample(f"{path}: {where}: not JSON ({exc}); each line must "
                                        "be one JSON object.")
                continue
            except RecursionError:
                yield where, _too_deep(path, where)
                continue
            yield where, _object(path, where, value)


def _text_chunks(path: Path) -> Iterator[str]:
    """The file's text, decoded incrementally (InvalidInput at the first non-UTF-8 byte)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with path.open("rb") as fh:
        while chunk := fh.read(READ_BYTES):
            try:
                yield decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"{path}: byte {done + exc.start}: not UTF-8; save the file "
                                   "as UTF-8.") from exc
            done += len(chunk)
        yield decoder.decode(b"", final=True)


def _json(path: Path) -> Iterator[Item]:
    """A top-level JSON array, element by element (else the file is read as JSON lines)."""
    chunks = _text_chunks(path)
    buf = ""
    for chunk in chunks:
        buf += chunk
        if buf.strip():
            break
    if not buf.lstrip().startswith("["):
        yield from _jsonl(path)
        return
    decoder, pos, number = json.JSONDecoder(), buf.index("[") + 1, 0
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos == len(buf):  # between elements at the end of the buffer: read on
            more = next(chunks, None)
            if not more:
                raise InvalidInput(f"{path}: element {number + 1}: the array is not closed.")
            buf, pos = more, 0
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
        except RecursionError as exc:  # where the element ends is unknown: the rest is lost
            raise InvalidInput(_too_deep(path, f"element {number + 1}").message) from exc
        except json.JSONDecodeError as exc:
            more = next(chunks, None) if _maybe_cut(exc, len(buf)) else None
            if not more:
                raise InvalidInput(f"{path}: element {number + 1}: not JSON ({exc}).") from exc
            buf, pos = buf[pos:] + more, 0
            continue
        number += 1
        yield f"element {number}", _object(path, f"element {number}", value)
        pos = end  # the buffer is cut only when it is refilled (no copy per element)


def _maybe_cut(exc: json.JSONDecodeError, read: int) -> bool:
    """Whether a decode error of an array element may come from where the read stopped (a
    string still open, or an error within :data:`CUT_MARGIN` of the end), not from the
    element itself."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= read - CUT_MARGIN


def _arrow_batches(path: Path, what: str) -> Iterator[Item]:
    """Rows of a Parquet or CSV file, record batch by record batch."""
    import pyarrow as pa

    row = 0
    try:
        if what == "parquet":
            import pyarrow.parquet as pq

            batches: Iterator[Any] = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
        else:
            import pyarrow.csv as pcsv

            with path.open(newline="", encoding="utf-8", errors="strict") as fh:
                header = fh.readline()
            names = next(csv.reader([header]), [])
            batches = pcsv.open_csv(path, convert_options=pcsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=False))
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield f"row {row}", record
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path}: row {row + 1}: not UTF-8; save the file as UTF-8.") \
            from exc
    except (pa.ArrowException, OSError) as exc:
        raise InvalidInput(f"{path}: row {row + 1}: unreadable as {what} ({exc}).") from exc


def _datasets(path: Path) -> Iterator[Item]:
    """Rows of a save_to_disk folder (memory-mapped Arrow files, read a batch at a time)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises its own and OS errors
        raise InvalidInput(f"{path}: unreadable as a datasets folder ({exc}).") from exc
    if not isinstance(ds, datasets.Dataset):
        raise InvalidInput(f"{path}: a DatasetDict; name one split's folder.")
    row = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            row += 1
            yield f"row {row}", dict(zip(names, values, strict=True))


def examples(path: Path) -> Iterator[Item]:
    """The examples of one input, in order, as (where, record or BadExample) pairs."""
    what = kind(path)
    if what == "jsonl":
        return _jsonl(path)
    if what == "json":
        return _json(path)
    if what == "datasets":
        return _datasets(path)
    return _arrow_batches(path, what)
