"""Internal: rich tables laid out by hand, the same characters in the same styles as rich lays them out.

rich measures every cell of a table, then renders every cell through its generic layout: about a millisecond a
row. ``explain --all`` prints one row per conversation (36,311 rows for a gigabyte of logs: half a minute of
printing after fifteen seconds of analysis), and a long agent conversation one row per turn. :class:`QuickTable`
asks rich only for the column widths, from a table holding the few cells that decide them, and lays out each
row itself: compact tables (no edge, collapsed padding) and rich's default boxed table (edges, padding on every
side). Tables it was not written for (lines between rows, row styles, sections, fixed widths...) are rich's to lay
out. ``explain --all``'s rows are given as plain strings: one that fits is one padded string, with no Text made for it.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text

_JUSTIFY: Final = ("left", "right", "default")


class QuickTable:
    """A compact rich table (no edge, one space of padding, collapsed) or a boxed one (rich's default: edges, one
    space of padding each side), no row styles or sections, whose cells are texts, laid out by hand; any other table
    is laid out by rich.

    ``rows`` (optional, for a table given with its columns only): the body as plain strings, the ``i``-th cell of
    a row a copy of ``cells[i]`` (its style, justify and wrapping) holding that string. A row of printable one-cell
    characters that fits its columns is then laid out as one string, without a Text per cell: the rows are added
    to the table only if rich lays it out."""

    def __init__(self, table: Table, rows: Sequence[Sequence[str]] | None = None,
                 cells: Sequence[Text] | None = None) -> None:
        if rows is not None and (cells is None or len(cells) != len(table.columns) or table.rows):
            raise ValueError("plain rows need a table with no rows and one template cell per column")
        self._table = table
        self._rows = rows
        self._cells = cells
        # (templates with spans or centred text are rich's to apply: such plain rows are handed to rich)
        self._plain = rows is not None and cells is not None and all(
            isinstance(x, Text) and not x.spans and x.justify in (None, *_JUSTIFY) for x in cells)

    @property
    def table(self) -> Table:
        """The rich table, every row in it."""
        if self._rows is not None and self._cells is not None:
            for row in self._rows:
                self._table.add_row(*(_as_text(s, kind) for s, kind in zip(row, self._cells, strict=True)))
            self._rows = None
        return self._table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType | Segment]:
        table = self._table
        if not _handled(table) or (self._rows is not None and not self._plain):
            yield self.table
            return
        body = _Body(table, self._rows, self._cells)
        try:  # (the widths come from rich's own layout code, which it does not promise to keep)
            widths = _widths(table, body, console, options)
        except (AttributeError, TypeError):
            yield self.table
            return
        if any(w < left + right + 1 for w, (left, right) in zip(widths, _pads(table), strict=True)):
            yield self.table  # (a column squeezed to nothing on a page too narrow: rich's own corner cases)
            return
        yield from _render(table, body, console, options, widths)


@dataclasses.dataclass
class _Body:
    """A table's body: its Text cells, or plain rows with one template cell per column."""

    table: Table
    rows: Sequence[Sequence[str]] | None
    cells: Sequence[Text] | None

    def column(self, i: int) -> tuple[list[str], list[Text]]:
        """Column ``i``'s plain texts, and its cells as Texts (empty for plain rows: made on demand)."""
        if self.rows is None:
            texts = [x for x in self.table.columns[i].cells if isinstance(x, Text)]
            return [x.plain for x in texts], texts
        return [row[i] for row in self.rows], []

    def text(self, i: int, k: int, texts: list[Text]) -> Text:
        """Column ``i``'s ``k``-th cell as a Text."""
        if self.rows is None:
            return texts[k]
        assert self.cells is not None
        return _as_text(self.rows[k][i], self.cells[i])


def _as_text(plain: str, kind: Text) -> Text:
    """``plain`` in a Text of ``kind``'s style, justify and wrapping."""
    return Text(plain, style=kind.style, justify=kind.justify, overflow=kind.overflow, no_wrap=kind.no_wrap)


def _pads(table: Table) -> list[tuple[int, int]]:
    """Each column's (left, right) padding, as rich pads its cells (for the tables _handled takes)."""
    last = len(table.columns) - 1
    return [(1, 1) if table.pad_edge else (0, 0 if i == last else 1) for i in range(last + 1)]


def _extra(table: Table) -> int:
    """The table's width beyond its columns': the dividers between them, and the edges."""
    return len(table.columns) - 1 + (2 if table.show_edge else 0)


def _handled(table: Table) -> bool:
    columns = table.columns
    return bool(
        columns and table.box is not None and table.show_header and not table.show_footer
        # (compact: no edge, padding collapsed, none at the edges; or rich's default: edges, padding on every side)
        and (table.show_edge, table.pad_edge, table.collapse_padding) in ((False, False, True), (True, True, False))
        and not table.show_lines and not table.leading and tuple(table.padding) == (0, 1, 0, 1)
        and not table.expand and table.width is None
        and table.min_width is None and not table.caption and not table.row_styles and str(table.style) in ("", "none")
        and not table.border_style and isinstance(table.title, (str, Text, type(None)))
        and not any(row.style or row.end_section for row in table.rows)
        and all(c.width is None and c.min_width is None and c.max_width is None and not c.ratio
                and c.vertical == "top" and c.justify in _JUSTIFY and isinstance(c.header, str)
                and all(isinstance(x, Text) and x.justify in (None, *_JUSTIFY) for x in c.cells) for c in columns))


# Printable characters rich counts as one cell each whatever the Unicode version: ASCII, and Latin-1 to the end of
# the spacing modifiers (no-break space and soft hyphen left out: a space where text is cut, and no cell at all).
# explain --all's "remote_hit×4" is one.
_ONE_CELL_LATIN: Final = re.compile("[\x20-\x7e\xa1-\xac\xae-\u02ff]*")


def _one_cell_each(plain: str) -> bool:
    """Printable text of one cell a character, one line (which rich's cell_len takes longer to find out)."""
    return plain.isprintable() if plain.isascii() else _ONE_CELL_LATIN.fullmatch(plain) is not None


def _width(plain: str) -> int:
    """Cells of a line of text, as rich counts them."""
    return len(plain) if _one_cell_each(plain) else cell_len(plain)


def _measure(plain: str) -> tuple[int, int]:
    """(minimum, maximum) width of a cell's text, as rich measures a Text."""
    if _one_cell_each(plain):
        words = plain.split()
        return (max(map(len, words)) if words else len(plain)), len(plain)
    lines = plain.splitlines()
    widest = max((cell_len(line) for line in lines), default=0)
    words = plain.split()
    return (max((cell_len(w) for w in words), default=widest)), widest


def _widths(table: Table, body: _Body, console: Console, options: ConsoleOptions) -> list[int]:
    """The columns' widths (padding included), computed by rich on a table that holds, per column, only the cell
    with the widest text and the cell with the widest word: rich takes the widest of each over a column's cells,
    before and after shrinking it to the page, so these decide the widths alone."""
    reduced = copy.copy(table)
    reduced.columns = []
    for i, column in enumerate(table.columns):
        plains, texts = body.column(i)
        sizes = [_measure(x) for x in plains]
        keep = sorted({max(range(len(plains)), key=lambda k: sizes[k][m]) for m in (0, 1)}) if plains else []
        reduced.columns.append(dataclasses.replace(column, _cells=[body.text(i, k, texts) for k in keep]))
    widths: list[int] = reduced._calculate_column_widths(  # (rich private: see _widths above)
        console, options.update_width(options.max_width - _extra(table)))
    return widths


def _lines(console: Console, text: Text, width: int, justify: Any, overflow: Any, no_wrap: bool) -> list[Text]:
    """A text wrapped at ``width`` as rich renders it in a cell (its own justify, overflow and no_wrap first)."""
    if not text.plain:
        return [Text()]
    return list(text.wrap(console, width, justify=text.justify or justify or "default",
                          overflow=text.overflow or overflow or "fold",
                          tab_size=console.tab_size if text.tab_size is None else text.tab_size,
                          no_wrap=text.no_wrap if text.no_wrap is not None else no_wrap))


def _fits(plain: str, cells: int, width: int) -> bool:
    """A text (``plain``, ``cells`` wide) that wrapping leaves as it is: one line, no tab, no trailing space,
    within ``width``."""
    return bool(plain) and "\n" not in plain and "\t" not in plain and not plain[-1].isspace() and cells <= width


def _cell(console: Console, text: Text, width: int, style: Style, column: Any) -> list[list[Segment]]:
    """A cell's lines, each exactly ``width`` cells wide, in the cell's style under the text's own."""
    text_plain = text.plain
    cells = _width(text_plain)
    if _fits(text_plain, cells, width):  # (most cells: Text.wrap is nine tenths of a row's cost)
        short = width - cells
        plain = [Segment(text_plain, style or None)] if not text.spans and not text.style else \
            list(Segment.apply_style(Text().append(text).render(console), style))
        if (text.justify or column.justify) == "right":
            return [[Segment(" " * short, style), *plain]] if short else [plain]
        return [[*plain, Segment(" " * short, style)]] if short else [plain]
    out = []
    for line in _lines(console, text, width, column.justify, column.overflow, column.no_wrap):
        segments = list(Segment.apply_style(Text().append(line).render(console), style))
        short = width - line.cell_len
        if short < 0:  # (a no_wrap text wider than the page: cropped, as rich crops it)
            segments = Segment.adjust_line_length(segments, width, style=style)
        elif short:
            segments.append(Segment(" " * short, style))
        out.append(segments)
    return out


def _render(table: Table, body: _Body, console: Console, options: ConsoleOptions, widths: list[int]
            ) -> Iterator[RenderableType | Segment]:
    box = table.box.substitute(options, safe=table.safe_box if table.safe_box is not None else console.safe_box) \
        if table.box is not None else None
    assert box is not None  # (checked by _handled)
    columns = table.columns
    table_width = sum(widths) + _extra(table)
    if table.title:
        title = (console.render_str(table.title, style=table.title_style or "table.title", highlight=False)
                 if isinstance(table.title, str) else table.title)
        yield from console.render(title, options.update(width=table_width, highlight=table.highlight, height=None,
                                                        justify=table.title_justify))
    header_style = console.get_style(table.header_style or "")
    heads = [(console.render_str(str(c.header), highlight=False), header_style + console.get_style(c.header_style))
             for c in columns]
    styles = [console.get_style(c.style or "") for c in columns]
    border = console.get_style(table.border_style or "")
    edge = table.show_edge
    pads = _pads(table)
    layout = _RowLayout(console, columns, widths, pads, border, edge)
    if edge:
        yield Segment(box.get_top(widths), border)
        yield Segment.line()
    yield from layout.lines(heads, (box.head_left, box.head_vertical, box.head_right), header=True)
    yield Segment(box.get_row(widths, "head", edge=edge), border)
    yield Segment.line()
    yield from _body_lines(table, body, layout, box, styles)
    if edge:
        yield Segment(box.get_bottom(widths), border)
        yield Segment.line()


def _body_lines(table: Table, body: _Body, layout: _RowLayout, box: Any, styles: list[Style]) -> Iterator[Segment]:
    """The rows, each as rich lays it out (the last one's dividers are the foot's)."""
    columns, widths, pads, edge = table.columns, layout.widths, layout.pads, layout.edge
    count = len(body.rows) if body.rows is not None else table.row_count

    def bars(index: int) -> tuple[str, str, str]:
        return ((box.foot_left, box.foot_vertical, box.foot_right) if index == count - 1
                else (box.mid_left, box.mid_vertical, box.mid_right))

    if body.rows is None:
        cells = [[x for x in c.cells if isinstance(x, Text)] for c in columns]
        for index, row in enumerate(zip(*cells, strict=True)):
            yield from layout.lines([(x, styles[i]) for i, x in enumerate(row)], bars(index))
        return
    assert body.cells is not None
    kinds = body.cells
    # a row whose cells are printable text of one cell a character and fit, in columns and cells with no style, is
    # one string: each cell padded to its width as _cell pads it, the dividers between (no style on any part of it)
    plain_columns = all(not styles[i] and not k.style for i, k in enumerate(kinds))
    right = [(k.justify or c.justify) == "right" for k, c in zip(kinds, columns, strict=True)]
    contents = [w - left - pad for w, (left, pad) in zip(widths, pads, strict=True)]
    for index, strings in enumerate(body.rows):
        left_bar, divider, right_bar = bars(index)
        if plain_columns and all(_one_cell_each(s) and _fits(s, len(s), w)
                                 for s, w in zip(strings, contents, strict=True)):
            line = divider.join(" " * lp + (s.rjust(w) if r else s.ljust(w)) + " " * rp
                                for s, w, r, (lp, rp) in zip(strings, contents, right, pads, strict=True))
            yield Segment(left_bar + line + right_bar if edge else line)
            yield Segment.line()
            continue
        yield from layout.lines([(_as_text(s, kinds[i]), styles[i]) for i, s in enumerate(strings)], bars(index))


@dataclasses.dataclass
class _RowLayout:
    """One row of cells laid out, line by line."""

    console: Console
    columns: list[Any]
    widths: list[int]
    pads: list[tuple[int, int]]
    border: Style
    edge: bool

    def lines(self, row: Sequence[tuple[Text, Style]], bars: tuple[str, str, str], *, header: bool = False
              ) -> Iterator[Segment]:
        """The row's lines; ``bars``: the left edge, the divider between cells and the right edge."""
        last = len(self.columns) - 1
        rendered = []
        for i, (text, style) in enumerate(row):
            left, right = self.pads[i]
            lines = _cell(self.console, text, self.widths[i] - left - right, style, self.columns[i])
            rendered.append((lines, left, right, style))
        height = max(len(lines) for lines, _, _, _ in rendered)
        for line_no in range(height):
            out: list[Segment] = [Segment(bars[0], self.border)] if self.edge else []
            for i, (lines, left, right, style) in enumerate(rendered):
                content = self.widths[i] - left - right
                if left:
                    out.append(Segment(" " * left, style))
                # (rows align their cells at the top, the header at the bottom)
                at = line_no - (height - len(lines)) if header else line_no
                out += lines[at] if 0 <= at < len(lines) else [Segment(" " * content, style)]
                if right:
                    out.append(Segment(" " * right, style))
                if i != last:
                    out.append(Segment(bars[1], self.border))
            if self.edge:
                out.append(Segment(bars[2], self.border))
            yield from _merged(out)
            yield Segment.line()


def _merged(line: list[Segment]) -> Iterator[Segment]:
    """A line's runs of one style as one segment each (a null style as none): the console handles each segment
    it is given, which costs more than laying the row out."""
    texts: list[str] = []
    style: Style | None = None
    for seg in line:
        this = seg.style or None
        if texts and this != style:
            yield Segment("".join(texts), style)
            texts = []
        style = this
        texts.append(seg.text)
    if texts:
        yield Segment("".join(texts), style)
