"""The updates one aggregation reads: opened, weighted and checked to agree with each other.

Every strategy starts here: :func:`open_updates` reads the manifests and opens each model
(one file or Hugging Face shards, :func:`xffl.aggregator.shards.open_model`) in a canonical
order (site, then digest); :func:`prepare` assigns weights and checks that run, round,
parent, tensor layout and config.json agree. The config a global is written with is the
coordinator's (the round's incoming global's bytes, :func:`own_config`), or its own
serialisation of the value the updates share: never an update's bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xffl.aggregator.decode import DecodedReader, Decoding
from xffl.aggregator.exchange import (
    Manifest,
    TensorInfo,
    finalize_manifest,
    index_of,
    read_manifest,
    read_small_file,
    staged_dir,
)
from xffl.aggregator.kinds import ModelKind, kind_of
from xffl.aggregator.metrics import SITE_ONLY_METRICS
from xffl.aggregator.strategy_catalog import WEIGHTINGS, Weighting
from xffl.aggregator.shards import TensorReader, open_model
from xffl.aggregator.verify import canonical_key, layout_difference
from xffl.core.errors import CheckpointError, InvalidInput


@dataclass
class Update:
    """One opened input, in canonical order."""

    path: Path
    manifest: Manifest
    site: str
    digest: str
    position: int  # index in the caller's list
    reader: TensorReader
    weight: float = 0.0


def open_updates(paths: Sequence[Path], decoding: Decoding | None = None) -> list[Update]:
    """Read manifests, open model files, sort canonically; close everything on failure.

    With ``decoding``, each update is read as the weights it encodes (a delta added to the
    reference global, or a narrower dtype widened to the global's).
    """
    opened: list[Update] = []
    try:
        for pos, raw in enumerate(paths):
            path = Path(raw)
            manifest = read_manifest(path)
            site, digest = canonical_key(path, manifest)
            try:
                model = open_model(path)
            except (CheckpointError, OSError) as exc:
                raise CheckpointError(f"update from site '{site}' ({path}): {exc}") from exc
            reader: TensorReader = model
            if decoding is not None:
                try:
                    reference = open_model(decoding.reference)
                except BaseException:
                    model.close()
                    raise
                reader = DecodedReader(model, reference, delta=decoding.delta,
                                       codec=decoding.codec)
            opened.append(Update(path, manifest, site, digest, pos, reader))
    except BaseException:
        for u in opened:
            u.reader.close()
        raise
    opened.sort(key=lambda u: (u.site, u.digest))
    return opened


def update_weight(manifest: Manifest, weighting: Weighting) -> float:
    """An update's raw FedAvg weight under a named ``weighting``."""
    if weighting == "samples":
        return float(manifest.num_samples)
    if weighting == "tokens":
        return float(manifest.num_tokens)
    if weighting == "uniform":
        return 1.0
    raise InvalidInput(f"unknown weighting {weighting!r}; use one of {', '.join(WEIGHTINGS)}.")


def _assign_weights(
    ups: list[Update], weights: Sequence[float] | None, weighting: Weighting | Mapping[str, float]
) -> str:
    """Set each update's raw weight; return a label of the weighting used."""
    if weights is not None:
        if len(weights) != len(ups):
            raise InvalidInput(f"{len(weights)} weights given for {len(ups)} updates.")
        for u in ups:
            u.weight = float(weights[u.position])
        label = "explicit"
    elif isinstance(weighting, Mapping):
        missing = sorted(u.site for u in ups if u.site not in weighting)
        if missing:
            raise InvalidInput(f"no weight given for site(s) {', '.join(missing)}.")
        for u in ups:
            u.weight = float(weighting[u.site])
        label = "explicit"
    else:
        for u in ups:
            u.weight = update_weight(u.manifest, weighting)
        label = weighting
    for u in ups:
        if not math.isfinite(u.weight) or u.weight < 0:
            raise InvalidInput(f"weight of site '{u.site}' is {u.weight}; weights must be >= 0.")
    if sum(u.weight for u in ups) <= 0:
        raise InvalidInput(
            f"all weights are zero under '{label}' weighting; the manifests may lack "
            "sample/token counts (try --weighting uniform)."
        )
    return label


def _agree(ups: list[Update], what: str, field: str, given: Any) -> Any:
    """The value of a manifest field that every update shares (``given``, else the first's)."""
    want = given if given is not None else getattr(ups[0].manifest, field)
    for u in ups:
        got = getattr(u.manifest, field)
        if got != want:
            raise CheckpointError(
                f"update from site '{u.site}' ({u.path}) has {what} {got!r}, expected {want!r}."
            )
    return want


def _common_layout(ups: list[Update]) -> list[TensorInfo]:
    """The tensor index all updates share (raises naming the first site that differs)."""
    ref = index_of(ups[0].reader)
    for u in ups[1:]:
        diff = layout_difference(index_of(u.reader), ref, f"site '{ups[0].site}'")
        if diff:
            raise CheckpointError(f"update from site '{u.site}' ({u.path}): {diff}.")
    return ref


def read_config(directory: Path, site: str) -> tuple[bytes | None, Any]:
    """An update's config.json (adapter_config.json for an adapter) as bytes and parsed
    (None, None when it has none)."""
    path = directory / kind_of(directory).config_file
    data = path.read_bytes() if path.is_file() else None
    try:
        return data, None if data is None else json.loads(data)
    except ValueError as exc:
        raise CheckpointError(
            f"update from site '{site}' ({directory}): unreadable {path.name}."
        ) from exc


def same_config(a: tuple[bytes | None, Any], b: tuple[bytes | None, Any]) -> bool:
    """Whether two :func:`read_config` results are the same config (or both absent)."""
    return (a[0] is None) == (b[0] is None) and a[1] == b[1]


def canonical_config(value: Any) -> bytes:
    """The coordinator's own serialisation of a config value (what a global is written with
    when no reference config is given)."""
    return (json.dumps(value, indent=2) + "\n").encode()


def own_config(global_dir: Path) -> bytes | None:
    """The config bytes of a global the coordinator holds (config.json, or adapter_config.json
    for an adapter), under the JSON size cap; None when it has none."""
    path = Path(global_dir) / kind_of(global_dir).config_file
    return read_small_file(path) if path.is_file() else None


def _common_config(ups: list[Update], reference: bytes | None) -> bytes | None:
    """The config the global is written with, after checking that all updates carry the same
    one (equal as JSON values, and to ``reference``'s when given): ``reference`` itself, or
    the coordinator's serialisation of the shared value. An update's bytes never pass on."""
    first = read_config(ups[0].path, ups[0].site)
    name = kind_of(ups[0].path).config_file
    for u in ups[1:]:
        if kind_of(u.path) != kind_of(ups[0].path):
            raise CheckpointError(f"site '{u.site}' and site '{ups[0].site}' sent different "
                                  "kinds of update (a model and a LoRA adapter).")
        if not same_config(read_config(u.path, u.site), first):
            raise CheckpointError(
                f"{name} of site '{u.site}' differs from that of site '{ups[0].site}'."
            )
    if reference is not None:
        if first[0] is not None and json.loads(reference) != first[1]:
            raise CheckpointError(f"{name} of site '{ups[0].site}' differs from the global "
                                  "model's.")
        return reference
    return None if first[0] is None else canonical_config(first[1])


def weighted_metrics(ups: list[Update]) -> dict[str, float]:
    """Weighted mean of each metric over the updates that report it.

    Validation numbers are left out: they measure the round's incoming global at each site
    (the federated one is weighted by held-out sequences, not by these weights).
    """
    out: dict[str, float] = {}
    for key in sorted({k for u in ups for k in u.manifest.metrics} - set(SITE_ONLY_METRICS)):
        have = [u for u in ups if key in u.manifest.metrics]
        wsum = math.fsum(u.weight for u in have)
        if wsum > 0:
            out[key] = math.fsum(u.weight * u.manifest.metrics[key] for u in have) / wsum
        else:
            out[key] = math.fsum(u.manifest.metrics[key] for u in have) / len(have)
    return out


@dataclass
class Prepared:
    """What every strategy starts from, once the updates are checked against each other."""

    label: str  # how the weights were assigned: samples, tokens, uniform or explicit
    run_id: str
    round: int
    parent: str | None
    layout: list[TensorInfo]  # the tensor index every update shares
    config: bytes | None  # the coordinator's config.json for the global, if any
    kind: ModelKind  # of the updates: whole models, or LoRA adapters (peft's file names)
    sites: dict[str, dict[str, Any]]  # per-site summary for the global's manifest


def prepare(
    ups: list[Update],
    weights: Sequence[float] | None,
    weighting: Weighting | Mapping[str, float],
    run_id: str | None,
    round: int | None,
    parent_digest: str | None,
    config: bytes | None = None,
) -> Prepared:
    """Checks and derivations every strategy starts with.

    One update per site, their weights, the run/round/parent they agree on, the common
    tensor layout and config (``config``: the coordinator's bytes to write it with), and the
    per-site summary for the manifest.
    """
    dup = {u.site for u in ups if sum(v.site == u.site for v in ups) > 1}
    if dup:
        raise CheckpointError(f"more than one update from site(s) {', '.join(sorted(dup))}.")
    label = _assign_weights(ups, weights, weighting)
    run: str = _agree(ups, "run id", "run_id", run_id)
    rnd: int = _agree(ups, "round", "round", round)
    parent: str | None = _agree(ups, "parent", "parent", parent_digest)
    layout = _common_layout(ups)
    config = _common_config(ups, config)
    total = math.fsum(u.weight for u in ups)
    sites = {
        u.site: {
            "num_samples": u.manifest.num_samples,
            "num_tokens": u.manifest.num_tokens,
            "metrics": dict(u.manifest.metrics),
            "weight": u.weight / total,
            "digest": u.digest,
        }
        for u in ups
    }
    return Prepared(label, run, rnd, parent, layout, config, kind_of(ups[0].path), sites)


@contextmanager
def prepared(paths: Sequence[Path], decoding: Decoding | None, weights: Sequence[float] | None,
             weighting: Weighting | Mapping[str, float], run_id: str | None, round: int | None,
             parent_digest: str | None, config: bytes | None = None,
             ) -> Iterator[tuple[list[Update], Prepared]]:
    """The updates at ``paths`` opened (:func:`open_updates`) and checked against each other
    (:func:`prepare`) for the block, closed after it."""
    if not paths:
        raise InvalidInput("no updates to aggregate.")
    ups = open_updates(paths, decoding)
    try:
        yield ups, prepare(ups, weights, weighting, run_id, round, parent_digest, config)
    finally:
        close_updates(ups)


# writes a global's tensors into a staging folder under the given single-file name and
# returns {file: sha256} of what it wrote
TensorWriter = Callable[[Path, str], dict[str, str]]


def write_global(
    out_dir: Path, ups: list[Update], prep: Prepared, extra: Mapping[str, Any],
    write_tensors: TensorWriter,
) -> Manifest:
    """Write a global checkpoint at ``out_dir`` atomically, as every strategy does.

    Its tensors come from ``write_tensors`` (named as a model or an adapter, like the
    updates), its config is the coordinator's (``prep.config``), and its manifest sums the
    updates' counts, holds the weighted mean of their metrics and ``extra``.
    """
    with staged_dir(Path(out_dir)) as tmp:
        sums = write_tensors(tmp, prep.kind.tensor_file)
        if prep.config is not None:
            (tmp / prep.kind.config_file).write_bytes(prep.config)
        manifest = Manifest(
            kind="global",
            run_id=prep.run_id,
            round=prep.round,
            parent=prep.parent,
            num_samples=sum(u.manifest.num_samples for u in ups),
            num_tokens=sum(u.manifest.num_tokens for u in ups),
            metrics=weighted_metrics(ups),
            extra=dict(extra),
        )
        return finalize_manifest(tmp, manifest, checksums=sums)


def close_updates(ups: Sequence[Update]) -> None:
    """Close the model files of every opened update."""
    for u in ups:
        u.reader.close()
