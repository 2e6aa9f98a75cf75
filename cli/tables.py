"""Tables for people and for pipes: boxes on a terminal, one tab-separated row per record otherwise.

On a terminal nothing is cut (rich's default at 80 columns turns ``completed`` into
``comp…`` and a loss into ``3.35…``): ids, numbers and states keep their width, headers wrap
at spaces, only the columns of free text (messages, paths, reasons) fold; a table whose
least widths do not fit the terminal keeps only its ``compact`` columns (the ones a narrow
terminal, 80 columns, has room for), and is printed as plain rows only if even those do not
fit. In a pipe or a file the table is always plain rows, like ``squeue -h`` with a header:
no boxes, no padding, no wrapping, nothing cut, so that ``cut -f``, ``awk -F'\\t'`` and
``grep`` see one record per line; ``tsv`` leaves out the title and the header line too.
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


def say(text: str) -> None:
    """Print a line of xffl's own markup: folded at the terminal's width (nothing wider than
    it), never folded in a pipe or a file (a path stays one word for ``grep``)."""
    console.print(text, soft_wrap=not console.is_terminal)


@dataclass
class Rows:
    """A table's header, rows and the rows that end a section. A cell is shown as the text
    it is (markup escaped, control characters written out: a facility's words in the
    registry cannot restyle or break the table), unless it is :class:`Markup`."""

    headers: Sequence[str]
    title: str | None = None
    text: Sequence[str] = ()  # the columns of free text, which may fold on a terminal
    compact: Sequence[str] = ()  # the columns kept on a terminal too narrow for all of them
    rows: list[list[str]] = field(default_factory=list)
    section_ends: set[int] = field(default_factory=set)

    def add(self, *cells: object, end_section: bool = False) -> None:
        """Append a row; ``end_section`` draws a rule under it on a terminal."""
        self.rows.append([c if isinstance(c, Markup) else markup_safe(c) for c in cells])
        if end_section:
            self.section_ends.add(len(self.rows) - 1)

    def _width(self, i: int, fold: int = 12) -> int:
        """Column ``i``'s least width: its longest header word, and its longest value unless
        it is free text (then at most ``fold``: such a column folds)."""
        words = max(len(w) for w in self.headers[i].split())
        longest = max((Text.from_markup(r[i]).cell_len for r in self.rows), default=1)
        return max(words, min(longest, fold) if self.headers[i] in self.text else longest)

    def print(self, tsv: bool = False) -> None:
        """Print the table as the output stream can take it; ``tsv``: the rows alone,
        tab-separated, without title or header (``xffl status --tsv | cut -f2,6``)."""
        if tsv:
            self._plain(header=False)
            return
        if console.is_terminal and self._boxed(range(len(self.headers))):
            return
        if console.is_terminal and self.compact and self._boxed(
                [i for i, h in enumerate(self.headers) if h in self.compact], fold=0):
            return
        self._plain(header=True)

    def _boxed(self, keep: Sequence[int], fold: int = 12) -> bool:
        """Draw the columns ``keep`` as a table if they fit the terminal (free text folded
        down to ``fold`` columns, or its header's longest word); whether they did."""
        headers = [self.headers[i] for i in keep]
        widths = [self._width(i, fold) for i in keep]
        whole = [w if h in self.text else max(w, len(h)) for h, w in zip(headers, widths,
                                                                          strict=True)]
        if sum(whole) + 2 * len(whole) <= console.width:
            widths = whole  # room for every header on one line
        if sum(widths) + 2 * len(widths) > console.width:
            return False
        table = Table(*(Column(h, overflow="fold", min_width=w,
                               max_width=None if h in self.text else w)
                        for h, w in zip(headers, widths, strict=True)),
                      title=self.title, box=box.SIMPLE_HEAD, collapse_padding=True,
                      pad_edge=False)
        for i, row in enumerate(self.rows):
            table.add_row(*(row[k] for k in keep), end_section=i in self.section_ends)
        console.print(table)
        return True

    def _plain(self, header: bool) -> None:
        """One tab-separated line per row (and the title and header line with ``header``)."""
        out = console.file  # written as is: rich would expand the tabs into spaces
        if header and self.title:
            out.write(f"# {self.title}\n")
        for row in [list(self.headers)] * header + self.rows:
            plain = (Text.from_markup(cell).plain for cell in row)
            out.write("\t".join(c.replace("\t", " ").replace("\n", " ") or "-"
                                for c in plain) + "\n")
        out.flush()
