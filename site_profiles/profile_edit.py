"""Change one top-level field of a profile file in place, its comments kept."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from xffl.core.files import atomic_write


def _scalar(value: str) -> str:
    """``value`` as YAML reads it back unchanged: plain when it can be, else quoted."""
    try:
        plain = yaml.safe_load(f"k: {value}") == {"k": value} and "#" not in value
    except yaml.YAMLError:
        plain = False
    return value if plain else json.dumps(value)


def set_top_level(path: Path, key: str, value: str) -> None:
    """Set ``key: value`` in ``path``: its line's value replaced (the line's comment kept),
    or the line added at the end; the file replaced atomically, its mode kept."""
    text = path.read_text()
    line_re = re.compile(rf"^{re.escape(key)}[ \t]*:[^\n]*$", re.M)
    new = f"{key}: {_scalar(value)}"
    match = line_re.search(text)
    if match is None:
        text = text + ("" if text.endswith("\n") or not text else "\n") + new + "\n"
    else:
        old = match.group(0)
        comment = re.search(r"[ \t]+#.*$", old[len(key) + 1:])
        text = text[:match.start()] + new + (comment.group(0) if comment else "") + \
            text[match.end():]
    mode = path.stat().st_mode & 0o7777
    atomic_write(path, text.encode())
    path.chmod(mode)
