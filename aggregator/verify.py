"""Admission of site updates: integrity, provenance, tensor layout, bounds and finite values.

A checkpoint that crossed a facility border is trusted only after :func:`check_update`:
what the folder holds (only the regular files its manifest lists, plus known side files,
each under its size cap, no links, no sub-folders), manifest fields (kind, run, round,
parent global digest), the counts and metrics it reports (finite, within what the
coordinator knows the site could have done: :class:`Bounds`), its config.json against the
global model's, the tensor layout against the global model, every file's sha256 and finite
tensor values. The model (one file, or Hugging Face shards with their index json) is read
once, slice by slice into a reused buffer, for both the checksums and the finiteness check,
and several updates are checked in parallel threads (hashing and numpy release the GIL).
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from xffl.aggregator.contents import check_config, check_contents, check_listed
from xffl.aggregator.dtypes import decode, encode
from xffl.aggregator.exchange import (
    Manifest,
    TensorInfo,
    index_of,
    read_manifest,
    sha256_file,
)
from xffl.aggregator.kinds import WHOLE_MODEL, ModelKind
from xffl.aggregator.reported import Bounds, check_reported
from xffl.aggregator.safetensors_io import (
    MAX_HEADER,
    STORAGE_DTYPES,
    Array,
    SafetensorsReader,
    header_cap,
)
from xffl.aggregator.shards import (
    INDEX_FILE,
    ModelReader,
    open_model,
)
from xffl.core.errors import CheckpointError
from xffl.core.versions import format_mismatch, same_format
from xffl.core.words import quoted

_SCAN_BYTES = 16 << 20


class UpdateRejected(CheckpointError):
    """An update failed admission; carries the directory, the site (or dir name) and why."""

    def __init__(self, directory: Path, site: str, reason: str) -> None:
        """Build the one-sentence message "update from site 'S' (DIR): REASON."."""
        super().__init__(f"update from site {quoted(site)} ({directory}): {reason}.")
        self.directory = Path(directory)
        self.site = site
        self.reason = reason


def site_label(directory: Path, manifest: Manifest | None) -> str:
    """The name an update goes by: its manifest's site, else its directory name."""
    return manifest.site if manifest is not None and manifest.site else Path(directory).name


def canonical_key(directory: Path, manifest: Manifest) -> tuple[str, str]:
    """Sort key that makes aggregation independent of argument order: (site, digest)."""
    return site_label(directory, manifest), manifest.digest()


def layout_difference(
    actual: Sequence[TensorInfo],
    reference: Sequence[TensorInfo],
    ref_name: str = "the global model",
) -> str | None:
    """Describe the first difference between two tensor indexes, or None if they match."""
    ref = {t.name: t for t in reference}
    act = {t.name: t for t in actual}
    for name in sorted(ref.keys() | act.keys()):
        if name not in act:
            return f"tensor {quoted(name)} is missing ({ref_name} has it)"
        if name not in ref:
            return f"unexpected tensor {quoted(name)} ({ref_name} has none)"
        a, r = act[name], ref[name]
        if a.shape != r.shape:
            return f"tensor '{name}' has shape {a.shape}, {ref_name} has {r.shape}"
        if a.dtype != r.dtype:
            return f"tensor '{name}' has dtype {a.dtype}, {ref_name} has {r.dtype}"
    return None


def _short(digest: str | None) -> str:
    return "none" if digest is None else digest[:12]


def _nonfinite(raw: Array, dtype: str) -> bool:
    if dtype == "BF16":
        return bool((np.bitwise_and(raw, np.uint16(0x7F80)) == 0x7F80).any())
    if dtype in ("F32", "F64", "F16"):
        return not bool(np.isfinite(raw).all())
    return False


def scan_model(reader: SafetensorsReader, *, check_finite: bool = True) -> tuple[str, str | None]:
    """One pass over a model file: its sha256 and the first tensor with NaN/Inf (or None)."""
    digest = hashlib.sha256()
    with reader.path.open("rb") as fh:
        digest.update(fh.read(reader.data_start))
    bad: str | None = None
    buffers: dict[str, Array] = {}
    for entry in sorted(reader.entries.values(), key=lambda e: e.start):
        step = max(1, _SCAN_BYTES // entry.itemsize)
        if entry.dtype not in buffers:
            buffers[entry.dtype] = np.empty(step, dtype=STORAGE_DTYPES[entry.dtype])
        for lo in range(0, entry.numel, step):
            hi = min(lo + step, entry.numel)
            reader.prefetch(entry.name, hi, min(hi + step, entry.numel))
            raw = reader.read_into(entry.name, lo, buffers[entry.dtype][: hi - lo])
            digest.update(raw.data.cast("B"))
            if check_finite and bad is None and _nonfinite(raw, entry.dtype):
                bad = entry.name
    return digest.hexdigest(), bad


def scan_shards(
    reader: ModelReader, *, check_finite: bool = True
) -> tuple[dict[str, str], str | None]:
    """:func:`scan_model` over every file of a model: {file: sha256} and the first bad tensor."""
    sums: dict[str, str] = {}
    bad: str | None = None
    for file, shard in reader.shards.items():
        sums[file], first = scan_model(shard, check_finite=check_finite and bad is None)
        bad = bad or first
    return sums, bad


def first_changed(update_dir: Path, previous_dir: Path, names: Iterable[str], *,
                  delta: bool = False) -> str | None:
    """The first of ``names`` whose value an update changed from the global's (None: none);
    both are already verified, and the update holds the global's tensors.

    The update is compared in the exchange's representation: a delta must hold zeros there,
    weights in a narrower dtype the global's values rounded to it as a site encodes them
    (round to nearest even), weights in the global's dtype its values exactly.
    """
    with open_model(update_dir) as update, open_model(previous_dir) as previous:
        for name in sorted(names):
            a, b = update.entries[name], previous.entries[name]
            if a.shape != b.shape:
                return name
            got = decode(update.raw(name), a.dtype)
            if delta:
                if got.any():  # +0 and -0 are both "no change"
                    return name
                continue
            want = decode(previous.raw(name), b.dtype)
            if a.dtype != b.dtype:  # the global's values as the exchange's dtype holds them
                stored = np.empty(want.size, dtype=STORAGE_DTYPES[a.dtype])
                encode(want, a.dtype, stored, np.empty(want.size, dtype=np.float32))
                want = decode(stored, a.dtype)
            if not np.array_equal(got, want):
                return name
    return None


def check_update(
    update_dir: Path,
    *,
    expected_round: int | None = None,
    expected_parent: str | None = None,
    reference_index: Sequence[TensorInfo] | None = None,
    expected_run_id: str | None = None,
    check_finite: bool = True,
    expected_config: Mapping[str, Any] | None = None,
    bounds: Bounds | Mapping[str, Bounds] | None = None,
    kind: ModelKind = WHOLE_MODEL,
) -> Manifest:
    """Admit one update or raise UpdateRejected naming its site and the reason.

    ``bounds`` may be one site's, or every site's by name (a run's sites under its job,
    ``xffl aggregate --run``): an update from a site not among them is then rejected.

    ``kind``: the global's (:mod:`xffl.aggregator.kinds`): the update must be of that kind
    (a LoRA adapter's: ``adapter_model.safetensors`` and ``adapter_config.json``).

    Checks, cheapest first: manifest (size capped, no link), format version, kind "update",
    site, run id, round, parent global digest, the folder's contents (with ``bounds``: only
    listed regular files and side files, caps), counts and metrics (finite; with ``bounds``,
    within them), config.json against ``expected_config``, the index json of a sharded model
    (its checksum first, then every shard listed and holding what it says), safetensors
    headers (truncation), tensor index against the manifest and against
    ``reference_index``, sha256 of every file, finite values. ``None`` skips a check.
    """
    directory = Path(update_dir)
    manifest: Manifest | None = None
    try:
        manifest = read_manifest(directory)
        site_bounds = _check_fields(manifest, bounds, expected_run_id, expected_round,
                                    expected_parent)
        _check_declared(directory, manifest, site_bounds, expected_config, kind)
        _check_files(directory, manifest, reference_index, check_finite)
    except UpdateRejected:
        raise
    except CheckpointError as exc:
        raise UpdateRejected(directory, site_label(directory, manifest),
                             str(exc).rstrip(".")) from exc
    except OSError as exc:
        raise UpdateRejected(directory, site_label(directory, manifest),
                             f"unreadable ({exc.strerror or exc})") from exc
    return manifest


def _check_fields(
    manifest: Manifest,
    bounds: Bounds | Mapping[str, Bounds] | None,
    run_id: str | None,
    round: int | None,
    parent: str | None,
) -> Bounds | None:
    """The manifest's own fields: format, kind, site (one of ``bounds``' when it names the
    sites), run, round and parent; returns the site's bounds. Raises CheckpointError."""
    if not same_format(manifest.format_version):
        raise CheckpointError(format_mismatch(manifest.format_version, manifest.xffl_version))
    if manifest.kind != "update":
        raise CheckpointError(f"kind is '{manifest.kind}', expected 'update'")
    if not manifest.site:
        raise CheckpointError("the manifest names no site")
    if isinstance(bounds, Mapping):
        if manifest.site not in bounds:
            raise CheckpointError(f"site {quoted(manifest.site)} is not a site of the job "
                                  f"({', '.join(sorted(bounds))})")
        bounds = bounds[manifest.site]
    if run_id is not None and manifest.run_id != run_id:
        raise CheckpointError(f"run id {quoted(manifest.run_id)}, expected {quoted(run_id)}")
    if round is not None and manifest.round != round:
        raise CheckpointError(f"round {manifest.round}, expected round {round}")
    if parent is not None and manifest.parent != parent:
        raise CheckpointError(
            f"trained from global {_short(manifest.parent)}, expected {_short(parent)}")
    return bounds


def _check_declared(
    directory: Path,
    manifest: Manifest,
    bounds: Bounds | None,
    expected_config: Mapping[str, Any] | None,
    kind: ModelKind,
) -> None:
    """What the site declares beside its tensors: the files listed (and, with ``bounds``,
    nothing else in the folder), its counts and metrics, its config. Raises CheckpointError."""
    check_listed(manifest.files, kind)
    if bounds is not None:
        check_contents(directory, manifest, bounds.side_files)
    check_reported(manifest, bounds or Bounds())
    if expected_config is not None:
        check_config(directory, expected_config, kind)


def _check_files(
    directory: Path,
    manifest: Manifest,
    reference_index: Sequence[TensorInfo] | None,
    check_finite: bool,
) -> None:
    """The files themselves: present, the shard index's checksum, the tensor index against
    the manifest and ``reference_index``, every file's sha256, finite values. Raises
    CheckpointError."""
    files = manifest.files
    for name in files:
        if not (directory / name).is_file():
            raise CheckpointError(f"{name} is missing")
    if INDEX_FILE in files and sha256_file(directory / INDEX_FILE) != files[INDEX_FILE]:
        raise CheckpointError(f"checksum mismatch for {INDEX_FILE}")
    cap = MAX_HEADER if reference_index is None else header_cap(
        (t.name, t.shape) for t in reference_index)
    with open_model(directory, cap) as reader:
        unlisted = [f for f in reader.files if f not in files]
        if unlisted:
            raise CheckpointError(f"the manifest does not list {unlisted[0]}, named in "
                                  f"{INDEX_FILE}")
        if index_of(reader) != manifest.tensors:
            raise CheckpointError("the tensor index of the model differs from the manifest")
        if reference_index is not None:
            diff = layout_difference(manifest.tensors, reference_index)
            if diff:
                raise CheckpointError(diff)
        for name, expected in sorted(files.items()):
            if name not in reader.shards and sha256_file(directory / name) != expected:
                raise CheckpointError(f"checksum mismatch for {name}")
        digests, bad = scan_shards(reader, check_finite=check_finite)
    for name, digest in digests.items():
        if digest != files[name]:
            raise CheckpointError(f"checksum mismatch for {name} (corrupted or altered in "
                                  "transfer)")
    if bad is not None:
        raise CheckpointError(f"tensor '{bad}' holds non-finite values (NaN or Inf)")


def select_updates(
    dirs: Iterable[Path],
    *,
    expected_round: int | None = None,
    expected_parent: str | None = None,
    reference_index: Sequence[TensorInfo] | None = None,
    expected_run_id: str | None = None,
    check_finite: bool = True,
    workers: int | None = None,
    bounds: Bounds | Mapping[str, Bounds] | None = None,
    check: Callable[[Path], Manifest] | None = None,
) -> tuple[list[tuple[Path, Manifest]], list[tuple[Path, str, str]]]:
    """Split update dirs into accepted (dir, manifest), in canonical order, and rejected.

    Rejected entries are (dir, site or dir name, reason). Besides :func:`check_update`, every
    update of a site that sent more than one is rejected, and without ``reference_index``
    the first accepted update (canonical order) sets the layout the others must match.
    Updates are checked in ``workers`` threads (default: one per CPU core); ``bounds``: as
    for :func:`check_update`; ``check``: the check of one update, instead of
    :func:`check_update` with these arguments.
    """
    paths = [Path(d) for d in dirs]

    def attempt(d: Path) -> Manifest | UpdateRejected:
        try:
            if check is not None:
                return check(d)
            return check_update(d, expected_round=expected_round, expected_parent=expected_parent,
                                reference_index=reference_index, bounds=bounds,
                                expected_run_id=expected_run_id, check_finite=check_finite)
        except UpdateRejected as exc:
            return exc

    n = max(1, min(len(paths), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="xffl-verify") as pool:
        outcomes = list(pool.map(attempt, paths))
    accepted: list[tuple[Path, Manifest]] = []
    rejected: list[tuple[Path, str, str]] = []
    for d, outcome in zip(paths, outcomes, strict=True):
        if isinstance(outcome, UpdateRejected):
            rejected.append((d, outcome.site, outcome.reason))
        else:
            accepted.append((d, outcome))
    by_site: dict[str, list[tuple[Path, Manifest]]] = defaultdict(list)
    for d, m in accepted:
        by_site[site_label(d, m)].append((d, m))
    kept: list[tuple[Path, Manifest]] = []
    for site, group in by_site.items():
        if len(group) == 1:
            kept.extend(group)
            continue
        others = ", ".join(str(d) for d, _ in group)
        reason = f"more than one update from this site ({others})"
        rejected.extend((d, site, reason) for d, _ in group)
    kept.sort(key=lambda dm: canonical_key(*dm))
    if reference_index is None and kept:
        first_dir, first = kept[0]
        ref_name = f"site '{site_label(first_dir, first)}'"
        still: list[tuple[Path, Manifest]] = [kept[0]]
        for d, m in kept[1:]:
            diff = layout_difference(m.tensors, first.tensors, ref_name)
            if diff:
                rejected.append((d, site_label(d, m), diff))
            else:
                still.append((d, m))
        kept = still
    return kept, rejected
