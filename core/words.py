"""A facility's words (a manifest's ``run_id`` or ``site``, its file and tensor names) quoted
at a stated length wherever they enter a reason, the registry or a log."""

from __future__ import annotations

#: the most characters of one site-provided word a reason quotes
WORD_CHARS = 64
#: the most characters of a site's reason (rejection, failure) the registry records
REASON_CHARS = 1000


def quoted(word: object, limit: int = WORD_CHARS) -> str:
    """``repr`` of a site's word, cut to ``limit`` characters with a marker naming its length:
    ``'abc'``, or ``'aaaa…'... (100000 characters)``."""
    text = str(word)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def capped(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` itself when at most ``limit`` characters, else its start and a marker."""
    if len(text) <= limit:
        return text
    marker = f"... ({len(text)} characters)"
    return text[:max(0, limit - len(marker))] + marker
