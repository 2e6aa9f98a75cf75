"""Safetensors headers: nothing xffl admits is refused by the real loader, and a long header
is refused before it is read.

Every crafted header below is refused by the safetensors crate (what transformers and peft
load with: asserted here with ``safe_open``), so xffl's reader must refuse it too; the
well-formed ones are accepted by both. An update whose header is longer than its tensors
need is rejected before any of it is read: tracemalloc sees less than a tenth of it.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.aggregator.conftest import write_checkpoint
from xffl.aggregator.exchange import read_manifest, sha256_file
from xffl.aggregator.safetensors_io import SafetensorsReader
from xffl.aggregator.verify import UpdateRejected, check_update
from xffl.core.errors import CheckpointError

T = '"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
REFUSED = {
    "float shape": b'{"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}',
    "exponent shape": b'{"a": {"dtype": "F32", "shape": [2e0], "data_offsets": [0, 8]}}',
    "bool shape": b'{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}',
    "string offsets": b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}',
    "three offsets": b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}',
    "NaN": b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}',
    "Infinity": b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 8]}}',
    "2**64": b'{"a": {"dtype": "F32", "shape": [18446744073709551616, 0], '
             b'"data_offsets": [0, 0]}}',
    "lower-case dtype": b'{"a": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}}',
    "metadata list": ('{"__metadata__": [], ' + T + "}").encode(),
    "metadata false": ('{"__metadata__": false, ' + T + "}").encode(),
    "metadata integer": ('{"__metadata__": {"format": 1}, ' + T + "}").encode(),
    "UTF-8 BOM": b"\xef\xbb\xbf{" + T.encode() + b"}",
    "UTF-16": ("{" + T + "}").encode("utf-16"),
    "top-level list": b"[1]",
    "hole": b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
    "trailing NUL": ("{" + T + "}").encode() + b"\0",
}


def _file(path: Path, header: bytes, data: bytes = b"\0" * 8) -> Path:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _crate_refuses(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as fh:
            list(fh.keys())
    except Exception:  # the crate's SafetensorError, or a header it cannot even decode
        return True
    return False


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_headers_the_crate_refuses_are_refused(tmp_path: Path, name: str) -> None:
    path = _file(tmp_path / "t.safetensors", REFUSED[name])
    assert _crate_refuses(path), name  # the premise: the real loader refuses it
    with pytest.raises(CheckpointError):
        SafetensorsReader(path).close()


def test_well_formed_headers_are_read_by_both(tmp_path: Path) -> None:
    for i, header in enumerate([("{" + T + "}").encode(), (" {" + T + "}").encode(),
                                ('{"__metadata__": null, ' + T + "}").encode(),
                                ('{"__metadata__": {"format": "pt"}, ' + T + "}").encode()]):
        path = _file(tmp_path / f"{i}.safetensors", header)
        assert not _crate_refuses(path)
        with SafetensorsReader(path) as reader:
            assert reader.entries["a"].shape == (2,)


def test_a_long_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    glob = write_checkpoint(tmp_path / "global", {"w": torch.ones(4)}, kind="global",
                            site=None, round=0)
    update = write_checkpoint(tmp_path / "site", {"w": torch.ones(4)}, round=1,
                              parent=read_manifest(glob).digest())
    pad = 32 << 20  # valid JSON: a 32 MiB __metadata__ string, then the real entry
    header = b'{"__metadata__": {"pad": "' + b"x" * pad + b'"}, "w": {"dtype": "F32", ' \
        b'"shape": [4], "data_offsets": [0, 16]}}'
    _file(update / "model.safetensors", header, b"\0" * 16)
    data = json.loads((update / "manifest.json").read_text())
    data["files"]["model.safetensors"] = sha256_file(update / "model.safetensors")
    (update / "manifest.json").write_text(json.dumps(data))
    tracemalloc.start()
    try:
        with pytest.raises(UpdateRejected, match="more than the 65766 allowed"):  # 2 x 115 + 64 KiB
            check_update(update, reference_index=read_manifest(glob).tensors)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the manifest's read reserves its 16 MiB cap; the 32 MiB header is never read
    assert peak < (17 << 20) < pad, peak
