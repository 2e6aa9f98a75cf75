"""Tables for people and for pipes: boxes on a terminal, one tab-separated row per record otherwise.

On a terminal nothing is cut (rich's default at 80 columns turns ``completed`` into
``comp…`` and a loss into ``3.35…``, and its own shrinking of a table too wide crops every
line): xffl fixes every width itself. Ids, numbers and states keep their width, headers wrap
at spaces, only the columns of free text (messages, paths, reasons) fold, at spaces or after
a ``/`` in a path, never inside a word (a run id in a message stays whole). A table whose
least widths do not fit the terminal keeps only its ``compact`` columns (the ones a narrow
terminal, 80 columns, has room for) and says which it hid; if even their free text does not
fit beside them, it goes on the lines under its row; the table is printed as plain rows only
if its compact columns cannot fit at all. In a pipe or a file the table is always plain rows,
like ``squeue -h`` with a header: no boxes, no padding, no wrapping, nothing cut, so that
``cut -f``, ``awk -F'\\t'`` and ``grep`` see one record per line; ``tsv`` leaves out the
title and the header line too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich import box
from rich.cells import cell_len
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


# where free text may fold: at a run of spaces, or after a ``/`` inside a word (a path)
_UNIT = re.compile(r"[^\s/]*/+|[^\s/]+")


def units(text: str) -> list[tuple[int, int]]:
    """The (start, end) of each piece of ``text`` a fold never splits: a word, or the part
    of a path up to and including its next ``/``."""
    return [m.span() for m in _UNIT.finditer(text)]


def folded(text: Text, width: int) -> Text:
    """``text`` broken into lines of at most ``width`` columns between its units (never
    inside one that fits a line); a unit wider than a line is split at the width."""
    lines: list[Text] = []
    for line in text.split("\n"):
        start: int | None = None
        end = 0
        for a, b in units(line.plain):
            if start is not None and cell_len(line.plain[start:b]) > width:
                lines.append(line[start:end])
                start = None
            while start is None and b - a > width:  # wider than a line: split it
                lines.append(line[a:a + width])
                a += width
            if start is None:
                start = a
            end = b
        lines.append(line[start:end] if start is not None else Text(""))
    return Text("\n").join(lines)


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

    def _least(self, i: int, fold: int) -> tuple[int, int]:
        """Column ``i``'s least and widest useful widths. The least: its longest header word
        and its longest value, or, for free text, its longest unit (:func:`units`: a run id
        never splits, a path only after a ``/``) and at least ``fold`` columns of it. The
        widest: its whole header and its longest value on one line."""
        values = [Text.from_markup(r[i]).plain for r in self.rows]
        header_word = max(cell_len(w) for w in self.headers[i].split())
        longest = max((cell_len(line) for v in values for line in v.splitlines() or [""]),
                      default=1)
        most = max(longest, cell_len(self.headers[i]))
        if self.headers[i] not in self.text:
            return max(header_word, longest), most
        unit = max((cell_len(v[a:b]) for v in values for a, b in units(v)), default=1)
        return max(header_word, unit, min(longest, fold)), most

    def _widths(self, keep: Sequence[int], fold: int) -> list[int] | None:
        """The widths of the columns ``keep`` on this terminal, or None if even their least
        widths do not fit: first every header whole on one line if all of them fit, then
        the free-text columns widened one column at a time, the narrowest first."""
        room = console.width - 2 * (len(keep) - 1)  # the gap between two columns
        bounds = [self._least(i, fold) for i in keep]
        widths = [least for least, _ in bounds]
        if sum(widths) > room:
            return None
        text = [self.headers[i] in self.text for i in keep]
        whole = [most if not t else least for t, (least, most) in zip(text, bounds, strict=True)]
        if sum(whole) <= room:
            widths = whole
        while sum(widths) < room:
            growing = [k for k, t in enumerate(text) if t and widths[k] < bounds[k][1]]
            if not growing:
                break
            widths[min(growing, key=lambda k: widths[k])] += 1
        return widths

    def print(self, tsv: bool = False) -> None:
        """Print the table as the output stream can take it; ``tsv``: the rows alone,
        tab-separated, without title or header (``xffl status --tsv | cut -f2,6``)."""
        if tsv:
            self._plain(header=False)
            return
        if console.is_terminal and self._boxed(range(len(self.headers))):
            return
        compact = [i for i, h in enumerate(self.headers) if h in self.compact]
        if console.is_terminal and self.compact and (self._boxed(compact, fold=0)
                                                     or self._stacked(compact)):
            hidden = [h for h in self.headers if h not in self.compact]
            say(f"[dim]{len(hidden)} column{'s' * (len(hidden) > 1)} hidden to fit "
                f"{console.width} columns: "
                f"{markup_safe(', '.join(hidden))} (a wider terminal or a pipe "
                "shows them)[/dim]")
            return
        self._plain(header=True)

    def _stacked(self, keep: Sequence[int]) -> bool:
        """The columns ``keep`` that are not free text as a table, each row's free text on
        the lines under it, indented and folded at the terminal's width (a message with a
        long run id in it at 80 columns); whether they fit."""
        short = [i for i in keep if self.headers[i] not in self.text]
        notes = [i for i in keep if self.headers[i] in self.text]
        widths = [self._least(i, 0)[1] for i in short]  # every value and header whole
        if not short or sum(widths) + 2 * (len(short) - 1) > console.width or any(
                self._least(i, 0)[0] > console.width - 2 for i in notes):
            return False
        gap, rule = Text("  "), Text("─" * (sum(widths) + 2 * (len(short) - 1)))
        lines = [Text(self.title, style="italic")] if self.title else []
        for n, row in enumerate([None, *self.rows]):
            cells = [Text(self.headers[i], style="bold") if row is None
                     else Text.from_markup(row[i]) for i in short]
            for cell, w in zip(cells, widths, strict=True):
                cell.pad_right(w - cell.cell_len)
            lines += [gap.join(cells)] + [rule] * (row is None)
            if row is None:
                continue
            for i in notes:
                note = Text.from_markup(row[i])
                if note.plain.strip("- "):
                    lines += [gap + part for part in
                              folded(note, console.width - 2).split("\n")]
            if n - 1 in self.section_ends:
                lines.append(rule)
        for line in lines:
            console.print(line, soft_wrap=True)
        return True

    def _boxed(self, keep: Sequence[int], fold: int = 12) -> bool:
        """Draw the columns ``keep`` as a table if they fit the terminal, no value cut and
        no word split (free text folds at spaces, down to ``fold`` columns or its longest
        word); whether they did. Every width is fixed here: rich's own shrinking would
        narrow an id column below its value and then crop the table's lines."""
        widths = self._widths(keep, fold)
        if widths is None:
            return False
        headers = [self.headers[i] for i in keep]
        table = Table(*(Column(h, overflow="fold", width=w)
                        for h, w in zip(headers, widths, strict=True)),
                      title=self.title, box=box.SIMPLE_HEAD, collapse_padding=True,
                      pad_edge=False, show_edge=False)
        for i, row in enumerate(self.rows):
            table.add_row(*(folded(Text.from_markup(row[k]), w) if self.headers[k] in self.text
                            else row[k] for k, w in zip(keep, widths, strict=True)),
                          end_section=i in self.section_ends)
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
