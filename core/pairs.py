"""``NAME=NUMBER`` options (strategy parameters, site weights) parsed one way everywhere."""

from __future__ import annotations

from collections.abc import Sequence

from xffl.core.errors import InvalidInput


def parse_pairs(pairs: Sequence[str], option: str = "--param", what: str = "KEY",
                example: str = "eta=0.01") -> dict[str, float]:
    """``NAME=NUMBER`` strings (site weights, strategy parameters) as a dict.

    A malformed pair is an InvalidInput naming the option and showing an example.
    """
    out: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise InvalidInput(
                f"{option} {pair!r}: expected {what}=NUMBER, e.g. {option} {example}."
            )
    return out
