"""The coordinator's reading of a site's evaluation file: untrusted input, parsed strictly.

A site's ``evaluation-<site>.json`` comes from a facility the coordinator does not control.
It is read with a size cap (links and other file types refused), parsed by a pydantic model
that forbids any other key, and checked against what the coordinator itself sent: the model
names must be exactly those it sent, every loss finite and not negative, ``samples`` a
whole number from 1 to the site's evaluation budget and ``tokens`` (the held-out targets in
the loss: the site's weight in a federated mean) a whole number from 0 to ``samples`` x
``seq_len``, what those sequences hold. The site a result belongs to is the
step it came back from, never a name inside the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr, ValidationError

from xffl.aggregator.exchange import read_small_file
from xffl.core.errors import CheckpointError

MAX_RESULT_BYTES = 64 << 10  # a few numbers per model; far more than any honest file


class EvaluationRejected(Exception):
    """A site's evaluation file is unusable; the message says why."""


class _Result(BaseModel):
    """The file's shape: ``{"format": 1, "site", "samples", "tokens", "losses": {NAME:
    LOSS}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal[1]
    site: StrictStr
    samples: StrictInt
    tokens: StrictInt
    losses: dict[StrictStr, StrictFloat | StrictInt]


@dataclass(frozen=True)
class SiteEvaluation:
    """One site's row of the matrix: the loss of every model on its held-out sequences."""

    site: str
    samples: int
    losses: dict[str, float]
    tokens: int = 0  # the held-out targets in the loss: the site's weight in a federated mean


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_evaluation(path: Path, site: str, models: list[str], budget: int,
                     seq_len: int) -> SiteEvaluation:
    """``site``'s result in ``path``, checked against the ``models`` sent, its ``budget`` and
    the targets a held-out sequence holds (``seq_len``).

    EvaluationRejected with the reason for anything else.
    """
    try:
        raw = read_small_file(path, MAX_RESULT_BYTES)
    except FileNotFoundError as exc:
        raise EvaluationRejected("no evaluation file came back") from exc
    except (OSError, CheckpointError) as exc:
        text = exc.message if isinstance(exc, CheckpointError) else str(exc)
        raise EvaluationRejected(f"unreadable evaluation file: {text}") from exc
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise EvaluationRejected(f"not JSON: {str(exc)[:200]}") from exc
    try:
        result = _Result.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise EvaluationRejected(f"field {where[:100]}: {first['msg']}") from exc
    if result.site != site:
        raise EvaluationRejected(f"the file says it is from site {result.site[:64]!r}, not "
                                 f"{site!r}")
    sent, got = set(models), set(result.losses)
    if got != sent:
        extra = sorted(got - sent)[:5]
        missing = sorted(sent - got)
        parts = ([f"models not sent: {', '.join(repr(n[:64]) for n in extra)}"] if extra
                 else []) + ([f"models missing: {', '.join(missing)}"] if missing else [])
        raise EvaluationRejected("; ".join(parts))
    losses: dict[str, float] = {}
    for name in models:
        value = result.losses[name]
        try:
            loss = float(value)
        except OverflowError:  # a whole number too big for a float (10**400)
            loss = math.inf
        if not math.isfinite(loss) or loss < 0:
            raise EvaluationRejected(f"the loss of model {name} is {_short(value)}, not a "
                                     "finite number >= 0")
        losses[name] = loss
    if not 1 <= result.samples <= budget:
        raise EvaluationRejected(f"samples is {_short(result.samples)}, outside 1..{budget} "
                                 "(the job's evaluation budget)")
    if not 0 <= result.tokens <= result.samples * seq_len:
        raise EvaluationRejected(f"tokens is {_short(result.tokens)}, outside "
                                 f"0..{result.samples * seq_len} (samples x seq_len)")
    return SiteEvaluation(site=site, samples=result.samples, losses=losses,
                          tokens=result.tokens)


def _short(value: float) -> str:
    """A site's number as a reason may quote it: at most 24 characters."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"
