"""Tables for people and for pipes: boxes on a terminal, one tab-separated row per record otherwise.

On a terminal nothing is cut (rich's default at 80 columns turns ``completed`` into
``comp…`` and a loss into ``3.35…``): ids, numbers and states keep their width, headers wrap
at spaces, only the columns of free text (messages, paths, reasons) fold; a table whose
least widths do not fit the terminal is printed as plain rows. In a pipe or a file the table
is always plain rows, like ``squeue -h`` with a header: no boxes, no padding, no wrapping,
nothing cut, so that ``cut -f``, ``awk -F'\\t'`` and ``grep`` see one record per line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich import box
from rich.table import Column, Table
from rich.text import Text

from xffl.cli.common import console, markup_safe


class Markup(str):
    """A table cell written in rich markup (xffl's own words); every other cell is text."""

    __slots__ = ()


@dataclass
class Rows:
    """A table's header, rows and the rows that end a section. A cell is shown as the text
    it is (markup escaped, control characters written out: a facility's words in the
    registry cannot restyle or break the table), unless it is :class:`Markup`."""

    headers: Sequence[str]
    title: str | None = None
    text: Sequence[str] = ()  # the columns of free text, which may fold on a terminal
    rows: list[list[str]] = field(default_factory=list)
    section_ends: set[int] = field(default_factory=set)

    def add(self, *cells: object, end_section: bool = False) -> None:
        """Append a row; ``end_section`` draws a rule under it on a terminal."""
        self.rows.append([c if isinstance(c, Markup) else markup_safe(c) for c in cells])
        if end_section:
            self.section_ends.add(len(self.rows) - 1)

    def _width(self, i: int) -> int:
        """Column ``i``'s least width: its longest header word, and its longest value unless
        it is free text (then at most 12: such a column folds)."""
        words = max(len(w) for w in self.headers[i].split())
        longest = max((Text.from_markup(r[i]).cell_len for r in self.rows), default=1)
        return max(words, min(longest, 12) if self.headers[i] in self.text else longest)

    def print(self) -> None:
        """Print the table as the output stream can take it."""
        widths = [self._width(i) for i in range(len(self.headers))]
        whole = [w if h in self.text else max(w, len(h)) for h, w in zip(self.headers, widths,
                                                                          strict=True)]
        if sum(whole) + 2 * len(whole) <= console.width:
            widths = whole  # room for every header on one line
        if console.is_terminal and sum(widths) + 2 * len(widths) <= console.width:
            table = Table(*(Column(h, overflow="fold", min_width=w,
                                   max_width=None if h in self.text else w)
                            for h, w in zip(self.headers, widths, strict=True)),
                          title=self.title, box=box.SIMPLE_HEAD, collapse_padding=True,
                          pad_edge=False)
            for i, row in enumerate(self.rows):
                table.add_row(*row, end_section=i in self.section_ends)
            console.print(table)
            return
        out = console.file  # written as is: rich would expand the tabs into spaces
        if self.title:
            out.write(f"# {self.title}\n")
        for row in [list(self.headers), *self.rows]:
            plain = (Text.from_markup(cell).plain for cell in row)
            out.write("\t".join(c.replace("\t", " ").replace("\n", " ") or "-"
                                for c in plain) + "\n")
        out.flush()
