"""The copies of a run in flight (what `xffl watch` and `xffl status` show) and the finished ones.

While StreamFlow moves a round's global to a site or an update back, xffl's data manager
(:mod:`xffl.workflows.extensions.transfers`) keeps ``transfers/<site>-<in|out>.json`` in
the run directory (bytes so far, of how many, MB/s, ETA), removed when the copy ends; each
finished copy is a row of the registry's ``transfers`` (its bytes, start and end).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xffl.jobs.registry.records import RoundRecord, Transfer
from xffl.jobs.report.breakdown import owning_round, round_starts


@dataclass(frozen=True)
class CopyInFlight:
    """One site's copy as its coordinator last wrote it (every half second)."""

    site: str
    direction: str  # "in" (the global to the site) or "out" (the update back)
    bytes: int
    total: int
    mb_s: float
    eta_s: float | None

    def describe(self) -> str:
        """``copy-back from beta: 3.1 of 12.8 MB, 1.9 MB/s, ETA 5 s``."""
        what = "copy-back from" if self.direction == "out" else "copy-out to"
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None else ""
        return (f"{what} {self.site}: {self.bytes / 1e6:.1f} of {self.total / 1e6:.1f} MB, "
                f"{self.mb_s:.1f} MB/s{eta}")


def _number(value: Any) -> float:
    """``value`` as a finite number, else ValueError (a file cut short, or not ours)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return float(value)


def copies_in_flight(run_dir: str | Path) -> list[CopyInFlight]:
    """The run's copies in flight, by site and direction (none once they ended)."""
    out = []
    for path in sorted(Path(run_dir, "transfers").glob("*.json")):
        try:  # written by this run's coordinator (owner-only); gone once the copy ends
            p = json.loads(path.read_text())
            eta = p.get("eta_s")
            out.append(CopyInFlight(
                site=str(p["site"]), direction="out" if p["direction"] == "out" else "in",
                bytes=int(_number(p["bytes"])), total=int(_number(p["total"])),
                mb_s=_number(p["mb_s"]), eta_s=None if eta is None else _number(eta)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


@dataclass(frozen=True)
class FinishedCopy:
    """One recorded copy: the round it belongs to, its bytes, seconds and rate."""

    round: int | None  # the round during which it started (None: before the first round)
    site: str
    direction: str
    bytes: int | None
    seconds: float
    mb_s: float | None


def finished_copies(transfers: list[Transfer], rounds: list[RoundRecord]) -> list[FinishedCopy]:
    """The recorded copies, each with its round (:func:`owning_round`, as the round
    breakdown counts them) and its MB/s."""
    starts = round_starts(rounds)
    out = []
    for t in transfers:
        owner = owning_round(starts, t.started)
        seconds = max(0.0, t.ended - t.started)
        rate = t.bytes / seconds / 1e6 if t.bytes and seconds > 0 else None
        out.append(FinishedCopy(owner, t.site, t.direction, t.bytes, seconds, rate))
    return out
