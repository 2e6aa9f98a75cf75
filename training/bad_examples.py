"""`xffl data prepare --max-bad N`: bad examples skipped and counted, up to N, else a stop.

A bad example (:class:`xffl.training.sources.BadExample`: a line that is not JSON, a field
missing or of the wrong type, a conversation its chat template refuses) is named by file,
line (element, row) and field. With ``--max-bad 0`` (the default) the first one stops the
preparation, as it always did, and its message says that ``--max-bad`` exists; with N > 0
each of the first N is reported as it is met and left out, and the N + 1st stops it with
all N + 1 named. ``meta.json`` records ``skipped: {count, first}`` (the first
:data:`KEEP` messages).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from xffl.core.errors import InvalidInput
from xffl.training.sources import BadExample

KEEP = 100  # messages meta.json keeps: enough to fix a file by, bounded whatever N is


@dataclass
class BadExamples:
    """The bad examples met so far, against the limit ``--max-bad`` set."""

    limit: int = 0
    on_skip: Callable[[str], None] | None = None  # told each skipped example's message
    messages: list[str] = field(default_factory=list)  # up to limit + 1 (the stop's list)
    count: int = 0

    def add(self, bad: BadExample) -> None:
        """Count ``bad`` and skip it; InvalidInput naming the first limit + 1 when over."""
        self.count += 1
        self.messages.append(bad.message)
        if self.count <= self.limit:
            if self.on_skip is not None:
                self.on_skip(bad.message)
            return
        if self.limit == 0:
            raise InvalidInput(f"{bad.message.rstrip('.')}; or pass --max-bad N to skip and "
                               "count up to N bad examples.")
        head = (f"more than {self.limit} bad examples (--max-bad {self.limit}): fix them, or "
                f"raise --max-bad; the first {self.limit + 1}:")
        raise InvalidInput(head, lines=[head, *self.messages])

    def meta(self) -> dict[str, Any]:
        """What meta.json records: ``{"count": K, "first": [the first KEEP messages]}``."""
        return {"count": self.count, "first": self.messages[:KEEP]}
