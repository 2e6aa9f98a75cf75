"""Federated validation of each global model, and the early stop it can decide.

In round ``r`` every site with held-out data evaluates the global model it receives (the
global of round ``r - 1``) before training; the aggregate step combines the admitted sites'
numbers into the federated validation loss of that global, ``sum(t_s L_s) / sum(t_s)`` with
``L_s`` site ``s``'s mean over its held-out targets in the loss and ``t_s`` their number
(``val_tokens``): the mean over every site's targets in the loss, as if one evaluator had
read all the sites' held-out data (Flower's ``weighted_loss_avg`` with tokens for examples;
for text data every sequence has ``seq_len`` targets, so it is the sequence-weighted mean),
and writes it to ``rounds/<r>/validation.json``. The run directory, not the registry, is what
the stop rule reads, so a plan run by ``streamflow run`` or ``cwltool`` stops where ``xffl
submit`` does.

One site cannot steer that mean beyond its admission bound (a validation loss is at most
3 x ln(vocabulary), :func:`xffl.aggregator.reported.max_val_loss`), but within it a site's
number still moves the mean by its share of the targets. So beside the mean the step records
the median across the admitted sites' own losses (``val_loss_median``), which fewer lying
sites than half cannot move outside the honest sites' range, and the stop rule reads the
median: a liar can neither stop a run nor keep it going.

The stop rule is Keras's EarlyStopping on that series: a value improves on the best so far
when it is lower by more than ``min_delta``; after ``patience`` values in a row that do not,
no further round runs, and ``stopped.json`` says why.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from xffl.aggregator.metrics import VAL_LOSS, VAL_LOSS_MEDIAN, VAL_LOSS_ROBUST
from xffl.core.files import read_json, write_json
from xffl.core.layout import RunLayout
from xffl.workflows.steps.verdict import Verdict


@dataclass(frozen=True)
class FederatedValidation:
    """The federated validation loss of the global model a round started from."""

    round: int  # the round that measured it: the global is round - 1's
    val_loss: float
    val_samples: int  # held-out sequences behind it, all sites'
    val_tokens: int  # their targets in the loss, all sites': the mean's denominator
    sites: dict[str, float]  # each admitted site's own val_loss
    site_tokens: dict[str, int]  # each admitted site's val_tokens: its weight
    # the median of ``sites``' values (of two, their mean): what the stop rule reads
    val_loss_median: float | None = None

    def write(self, path: Path) -> None:
        """Store as JSON (atomically)."""
        write_json(path, asdict(self))


def federated(rnd: int, verdicts: list[Verdict]) -> FederatedValidation | None:
    """The admitted sites' validation losses weighted by their held-out targets in the loss
    (None: no admitted site measured any; a site whose held-out sequences hold no target in
    the loss weighs nothing, and its loss of no target is left out)."""
    return combine(rnd, [(v.site, v.val_loss, v.val_samples or 0, v.val_tokens)
                         for v in verdicts if v.accepted and v.val_loss is not None])


def combine(rnd: int, rows: list[tuple[str, float, int, int | None]]
            ) -> FederatedValidation | None:
    """The federated loss of (site, loss, held-out sequences, their targets in the loss)
    rows: the mean weighted by the targets, and the median of the sites' own losses (None:
    no row has a target; a row without one weighs nothing and is left out)."""
    measured = [(s, value, n, t) for s, value, n, t in rows if t]
    if not measured:
        return None
    total = sum(t for *_, t in measured)
    loss = math.fsum(value * t for _, value, _, t in measured) / total
    return FederatedValidation(round=rnd, val_loss=loss,
                               val_samples=sum(n for *_, n, _ in measured), val_tokens=total,
                               sites={s: value for s, value, *_ in measured},
                               site_tokens={s: t for s, *_, t in measured},
                               val_loss_median=statistics.median(v for _, v, *_ in measured))


def history(layout: RunLayout, last: int) -> list[tuple[int, float]]:
    """(round, federated validation loss) of rounds 1..``last`` that recorded one: its median
    across sites (the weighted mean in a file written before the median was recorded)."""
    out: list[tuple[int, float]] = []
    for rnd in range(1, last + 1):
        try:
            data = json.loads(layout.validation_file(rnd).read_text())
        except FileNotFoundError:
            continue
        value = data.get(VAL_LOSS_MEDIAN)
        out.append((rnd, float(data[VAL_LOSS] if value is None else value)))
    return out


def stop_reason(series: list[tuple[int, float]], patience: int,
                min_delta: float) -> str | None:
    """Why to stop after this series of (round, val_loss), or None to go on."""
    best, best_round, waited = math.inf, 0, 0
    for rnd, loss in series:
        if loss < best - min_delta:
            best, best_round, waited = loss, rnd, 0
        else:
            waited += 1
    if waited < patience:
        return None
    return (f"stopped early: the federated validation loss has not improved by more than "
            f"{min_delta:g} in {waited} round(s) (training.stop_when patience {patience}, on "
            f"{VAL_LOSS_ROBUST}); best {best:.4f}, of the global model round {best_round} "
            "started from")


@dataclass(frozen=True)
class Stopped:
    """A run's early stop: after which round, and why."""

    round: int
    reason: str


def write_stopped(layout: RunLayout, stopped: Stopped) -> None:
    """Record the early stop in the run directory (atomically)."""
    write_json(layout.stopped, asdict(stopped))


def read_stopped(layout: RunLayout) -> Stopped | None:
    """The run's early stop, if it stopped early."""
    data = read_json(layout.stopped)
    if data is None:
        return None
    return Stopped(round=int(data["round"]), reason=str(data["reason"]))
