"""Sizes written by people (5GB, 500MB, 2GiB): the one parser and the shard-size default."""

from __future__ import annotations

import re

from xffl.core.errors import InvalidInput

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default
_UNITS = {
    **{"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12},
    **{"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40},
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | str | None) -> int | None:
    """Bytes of a size such as 5GB, 500MB, 2GiB or 1000000; None or 0 means "do not shard"."""
    if value is None:
        return None
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(value)
        if not match or match.group(2).upper() not in _UNITS:
            raise InvalidInput(
                f"max shard size {value!r}: expected a number of bytes with an optional unit "
                "(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB or 500MB."
            )
        number, unit = float(match.group(1)), match.group(2).upper()
    if number < 0:
        raise InvalidInput(f"max shard size {value!r} is negative.")
    size = int(number * _UNITS[unit])
    return size or None
