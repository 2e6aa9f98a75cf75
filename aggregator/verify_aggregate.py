"""One verify-then-aggregate, for ``xffl aggregate``, the round's admit and aggregate steps and
``xffl simulate``.

:class:`RoundRules` is what every update of a round is checked against: the global the round
started from (its digest, run, tensors as the exchange sends them, config and kind) and the
job's exchange, bounds and LoRA rule; :func:`round_rules` reads them from that global.
:func:`verify_update` is the one check of one update. :func:`verify_and_aggregate` checks a
round's updates with it and aggregates the admitted ones under :class:`Aggregation`: all at
once (every strategy), or folded into a running FedAvg one by one as they arrive
(``fold=True``: averaging strategies only; memory does not grow with the number of updates).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from xffl.aggregator.adapter import frozen_tensors
from xffl.aggregator.decode import bad_scales, first_overflow
from xffl.aggregator.engine import Progress, run_strategy
from xffl.aggregator.exchange import Manifest, TensorInfo, read_manifest, read_small_file
from xffl.aggregator.exchange_spec import ExchangeSpec
from xffl.aggregator.inputs import own_config, update_weight
from xffl.aggregator.kinds import WHOLE_MODEL, ModelKind, kind_of
from xffl.aggregator.reported import Bounds
from xffl.aggregator.running import RunningAggregate
from xffl.aggregator.strategy_catalog import Weighting, get
from xffl.aggregator.verify import (
    UpdateRejected,
    check_update,
    first_changed,
    select_updates,
    site_label,
)
from xffl.core.errors import InvalidInput
from xffl.core.words import quoted


@dataclass(frozen=True)
class RoundRules:
    """What every update of one round must satisfy (None: that check is skipped)."""

    previous: Path | None  # the global the round started from
    parent: Manifest | None  # its manifest
    exchange: ExchangeSpec
    round: int | None
    run_id: str | None
    parent_digest: str | None
    reference: list[TensorInfo] | None  # the tensors an update holds, as the exchange sends them
    config: Any  # the global's config, as JSON: the update's must equal it
    kind: ModelKind
    bounds: Bounds | Mapping[str, Bounds] | None = None
    check_finite: bool = True
    freeze_a: bool = False  # a LoRA adapter's A matrices must stay the global's


def round_rules(previous: Path | None, *, exchange: ExchangeSpec | None = None,
                round: int | None = None, run_id: str | None = None,
                same_run: bool = True, parent_digest: str | None = None,
                bounds: Bounds | Mapping[str, Bounds] | None = None,
                check_finite: bool = True, freeze_a: bool = False) -> RoundRules:
    """The rules of a round that started from the global ``previous``: updates name it as
    parent, hold its tensors in the ``exchange``'s encoding, carry its config and kind and
    (``same_run``, no ``run_id``) its run. Without it, ``parent_digest`` is the parent
    asked for and the first update (in canonical order) sets the layout."""
    exchange = exchange or ExchangeSpec()
    if previous is None:
        return RoundRules(None, None, exchange, round, run_id, parent_digest, None, None,
                          WHOLE_MODEL, bounds, check_finite, freeze_a)
    previous = Path(previous)
    parent = read_manifest(previous)
    kind = kind_of(previous)  # the coordinator's global decides what an update may be
    config_file = previous / kind.config_file
    config = json.loads(read_small_file(config_file)) if config_file.is_file() else None
    return RoundRules(previous, parent, exchange, round,
                      run_id or (parent.run_id if same_run else None), parent.digest(),
                      list(exchange.reference(parent.tensors)), config, kind, bounds,
                      check_finite, freeze_a)


def verify_update(rules: RoundRules, update: Path, site: str | None = None) -> Manifest:
    """Admit one update under ``rules``, or raise UpdateRejected with the reason.

    :func:`xffl.aggregator.verify.check_update` (manifest, sha256, layout, config, bounds,
    finite values); then, with ``site`` (the coordinator's name for the sender), that the
    update says it comes from there; with the global, that a quantized update's scales and
    a delta added to the global are finite, and (``freeze_a``) that the A matrices of a LoRA
    adapter are the global's, bit for bit.
    """
    manifest = check_update(update, expected_round=rules.round,
                            expected_parent=rules.parent_digest,
                            reference_index=rules.reference, expected_run_id=rules.run_id,
                            check_finite=rules.check_finite, expected_config=rules.config,
                            kind=rules.kind, bounds=rules.bounds)
    label = site or site_label(update, manifest)
    if site is not None and manifest.site != site:
        raise UpdateRejected(update, site, f"the update says it comes from site "
                                           f"{quoted(manifest.site)}, not {site!r}")
    if rules.previous is None or rules.parent is None:
        return manifest
    exchange, previous = rules.exchange, rules.previous
    scales = None if exchange.codec is None else bad_scales(update, previous, exchange.codec)
    if scales is not None:
        raise UpdateRejected(update, label, scales)
    if exchange.update == "delta":
        overflow = first_overflow(update, previous, exchange.codec)
        if overflow is not None:
            raise UpdateRejected(update, label, f"its delta of tensor {overflow!r} added to "
                                                "the global model overflows its dtype")
    if rules.freeze_a:
        changed = first_changed(update, previous, frozen_tensors(rules.parent.tensors),
                                delta=exchange.update == "delta")
        if changed is not None:
            raise UpdateRejected(update, label, f"it changed {changed!r}, which "
                                 "aggregation.lora: freeze_a keeps at the global's value")
    return manifest


@dataclass(frozen=True)
class Aggregation:
    """How the admitted updates are combined: the job spec's ``aggregation`` section (or
    ``xffl aggregate``'s options)."""

    strategy: str = "fedavg"
    weighting: Weighting | Mapping[str, float] = "samples"  # or each site's explicit weight
    params: Mapping[str, float] = field(default_factory=dict)
    max_shard_size: int | str | None = None
    clip_norm: float | None = None
    max_weight_share: float | None = None


@dataclass(frozen=True)
class Aggregated:
    """What :func:`verify_and_aggregate` did: the new global's manifest, the updates in it
    (in the order aggregated) and those rejected (dir, site or dir name, reason)."""

    manifest: Manifest
    accepted: list[Path]
    manifests: dict[Path, Manifest]  # the accepted updates' (empty when ``verified``)
    rejected: list[tuple[Path, str, str]]


class TooFewUpdates(Exception):
    """Fewer updates passed verification than the caller's minimum; nothing was written."""

    def __init__(self, accepted: int, needed: int, rejected: list[tuple[Path, str, str]]) -> None:
        """The sentence "N update(s) accepted, at least M needed." and the rejections."""
        self.message = f"{accepted} update(s) accepted, at least {needed} needed."
        super().__init__(self.message)
        self.rejected = rejected


def verify_and_aggregate(
    rules: RoundRules, how: Aggregation, updates: Iterable[Path], out: Path, *,
    verified: bool = False, min_updates: int = 1, fold: bool = False,
    on_update: Callable[[Path, Manifest], None] | None = None,
    extra: Mapping[str, Any] | None = None, progress: Progress | None = None,
) -> Aggregated:
    """Verify ``updates`` under ``rules`` (:func:`verify_update`) and aggregate the admitted
    ones as ``how`` says into the global checkpoint ``out``.

    At once (default): every update is checked (in threads), a site that sent two is rejected
    with both, fewer than ``min_updates`` admitted raises :class:`TooFewUpdates`, then the
    strategy runs over them (:func:`xffl.aggregator.engine.run_strategy`). ``verified``: the
    updates were admitted already, one by one as they came (the round's admit step), and
    are aggregated as given. ``fold``: each update is checked as the iterable yields it
    (the first rejection raises), folded into a running FedAvg, then passed to
    ``on_update`` (which may delete it); a strategy that steps from the mean takes its step
    once all are in, ``extra`` is recorded in the global's manifest.
    """
    if fold:
        return _fold(rules, how, updates, Path(out), on_update, extra)
    manifests: dict[Path, Manifest] = {}
    rejected: list[tuple[Path, str, str]] = []
    if verified:
        accepted = [Path(u) for u in updates]
    else:
        kept, rejected = select_updates(updates, reference_index=rules.reference,
                                        check=partial(verify_update, rules))
        if len(kept) < min_updates:
            raise TooFewUpdates(len(kept), min_updates, rejected)
        accepted = [d for d, _ in kept]
        manifests = dict(kept)
    manifest = run_strategy(
        how.strategy, accepted, rules.previous, out, weighting=how.weighting,
        params=how.params, run_id=rules.run_id, round=rules.round,
        parent_digest=rules.parent_digest, max_shard_size=how.max_shard_size,
        clip_norm=how.clip_norm, max_weight_share=how.max_weight_share,
        decoding=None if rules.previous is None else rules.exchange.decoding(rules.previous),
        progress=progress)
    return Aggregated(manifest, accepted, manifests, rejected)


def _fold(rules: RoundRules, how: Aggregation, updates: Iterable[Path], out: Path,
          on_update: Callable[[Path, Manifest], None] | None,
          extra: Mapping[str, Any] | None) -> Aggregated:
    """:func:`verify_and_aggregate` with ``fold``: a running FedAvg, then the strategy's step."""
    strategy = get(how.strategy)
    if strategy.robust or isinstance(how.weighting, Mapping) or how.clip_norm is not None \
            or how.max_weight_share is not None:
        raise InvalidInput(f"folding updates one by one takes an averaging strategy weighted "
                           f"by samples, tokens or uniform, without bounds ({how.strategy}).")
    if rules.previous is None or rules.parent is None or rules.round is None \
            or rules.run_id is None:
        raise InvalidInput("folding updates needs the global the round started from.")
    previous, parent = rules.previous, rules.parent
    agg = RunningAggregate(parent.tensors, own_config(previous))
    decoding = rules.exchange.decoding(previous)
    accepted: list[Path] = []
    for update in updates:
        manifest = verify_update(rules, update)
        agg.add(update, update_weight(manifest, how.weighting), manifest, decoding)
        accepted.append(update)
        if on_update is not None:
            on_update(update, manifest)
    if strategy.mean:
        result = agg.write(out, run_id=rules.run_id, round=rules.round,
                           parent=parent.digest(), extra=extra,
                           max_shard_size=how.max_shard_size)
        return Aggregated(result, accepted, {}, [])
    mean = out.parent / ".mean"
    agg.write(mean, kind="update", site=f"mean-of-{agg.count}", run_id=rules.run_id,
              round=rules.round, parent=parent.digest(), extra=extra)
    try:
        result = run_strategy(how.strategy, [mean], previous, out, weighting="uniform",
                              params=how.params, run_id=rules.run_id, round=rules.round,
                              parent_digest=parent.digest(),
                              max_shard_size=how.max_shard_size)
    finally:
        shutil.rmtree(mean, ignore_errors=True)
    return Aggregated(result, accepted, {}, [])
