"""explain's turn table and each turn's details are laid out by hand (rich's layout measures every cell first, a
millisecond a row); they read exactly as rich's table and grid do, character by character and style by style.

The details: indent, dim label, text wrapped at words beside it, a word wider than the page folded, the evidence
line cut at the page's edge. The table: title, bold header, rule, columns justified. Checked on random texts and
widths against rich's own layout, with negative controls.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from kvdiag.diagnostics import terminal_table
from kvdiag.diagnostics.terminal import _INDENT, _LABEL_WIDTH, TurnDetails, cell, compact_table, render_text
from kvdiag.diagnostics.terminal_table import QuickTable

ROOT = Path(__file__).resolve().parent.parent


def _as_grid(details: TurnDetails, *, label_width: int = _LABEL_WIDTH) -> list[RenderableType]:
    """The same rows as the rich grid explain printed before (the reference layout)."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=_INDENT, no_wrap=True)
    grid.add_column(width=label_width, no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for label, text in details.rows:
        grid.add_row("", label, text)
    return [details.head, grid]


# (no tab: the grid measured a tab as no cell and wrapped "a\tb" over nine lines; see the last test)
_WORD = st.text(alphabet=st.sampled_from("abcdefghij0123456789,.:;=()/-_é界"), min_size=1, max_size=40)
_PARAGRAPH = st.lists(_WORD, min_size=0, max_size=30).map(" ".join)
_ROWS = st.lists(
    st.tuples(st.sampled_from(["reason", "reuse", "trimmed", "trim fix", "WRONG KV", "fix", "evidence", ""]),
              _PARAGRAPH, st.sampled_from(["wrap", "fold", "clip"])),
    min_size=1, max_size=8)


def _details(rows: list[tuple[str, str, str]]) -> TurnDetails:
    texts = []
    for label, body, kind in rows:
        if kind == "clip":
            texts.append((label, Text(body, no_wrap=True, overflow="crop", style="dim")))
        elif kind == "fold":
            texts.append((label, Text(body, overflow="fold")))
        else:
            texts.append((label, Text(body, style="bold red" if label == "WRONG KV" else "")))
    return TurnDetails(Text("turn 3  remote_hit (confirmed)", style="bold"), texts)


def _styled(parts: list[RenderableType], width: int) -> list[list[tuple[str, str]]]:
    """Each line's visible characters with their style, as a colour terminal shows them."""
    console = Console(width=width, color_system="standard", force_terminal=True, highlight=False)
    out = []
    for part in parts:
        for line in console.render_lines(part, console.options, pad=False):
            # (no style and the null style print alike)
            out.append([(ch, str(seg.style or "none")) for seg in line for ch in seg.text if not ch.isspace()])
    return out


@settings(max_examples=300, deadline=None)
@given(rows=_ROWS, width=st.integers(min_value=40, max_value=200))
def test_details_read_as_the_grid_did(rows: list[tuple[str, str, str]], width: int) -> None:
    details = _details(rows)
    assert render_text([details], width) == render_text(_as_grid(details), width)
    assert _styled([details], width) == _styled(_as_grid(details), width)  # dim labels, dim evidence, bold red


def test_a_long_paragraph_wraps_under_its_text_column() -> None:
    body = "the router's entry had expired before the next turn arrived; " * 4
    out = render_text([_details([("reason", body, "wrap"), ("evidence", "/var/log/x.log:12", "fold")])], 60)
    lines = out.splitlines()
    assert lines[1].startswith("   reason    the router")
    assert all(len(line) <= 60 for line in lines)
    assert all(line.startswith(" " * 13) for line in lines[2:-1])  # continuation lines stay under the text
    assert lines[-1].startswith("   evidence  /var/log/x.log:12")


def test_the_style_comparison_catches_a_lost_style() -> None:
    # negative control: the evidence line without its dim style is told apart (Text.render alone drops it)
    details = _details([("", "2026-11-29 06:55:01 [INFO] disagg_proxy: [1a2b3c]", "clip")])
    plain = TurnDetails(details.head, [(label, Text(text.plain, no_wrap=True)) for label, text in details.rows])
    assert render_text([plain], 80) == render_text([details], 80)
    assert _styled([plain], 80) != _styled([details], 80)


def test_the_comparison_catches_a_shifted_column() -> None:
    # negative control: a grid one column wider for the labels reads differently, and the check sees it
    details = _details([("reason", "P read the conversation's KV back from D over NIXL", "wrap")])
    assert render_text([details], 80) != render_text(_as_grid(details, label_width=_LABEL_WIDTH + 1), 80)


def test_a_tab_is_expanded_in_place() -> None:
    out = render_text([_details([("evidence", "/logs/odd\tname.log:7", "fold")])], 80)
    assert out.splitlines()[1] == "   evidence  /logs/odd       name.log:7"


# ----------------------------------------------------------------------------------------- the turn table

_CELL = st.one_of(st.integers(min_value=0, max_value=10**9).map(lambda n: f"{n:,}"),
                  st.sampled_from(["first_turn", "remote_hit", "metadata_not_returned*", "-", "153 ms", "1.2 s",
                                   "09:11:06", "11-29 09:11:06", "界面", "é"]))


def _table(title: str | None, rows: list[list[str]], styles: list[str]) -> Table:
    table = compact_table(Text(title) if title is not None else None)
    for name, justify in (("turn", "right"), ("start", "left"), ("TTFT", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row, style in zip(rows, styles, strict=False):
        table.add_row(*(cell(x) for x in row[:3]), cell(row[3], style))
    return table


@settings(max_examples=300, deadline=None)
@given(title=st.one_of(st.none(), st.text(alphabet="abcé界 -_:()0123456789", max_size=90)),
       rows=st.lists(st.lists(_CELL, min_size=4, max_size=4), min_size=0, max_size=12),
       styles=st.lists(st.sampled_from(["", "red", "green"]), min_size=12, max_size=12),
       width=st.integers(min_value=20, max_value=160))
def test_the_turn_table_reads_as_rich_lays_it_out(title: str | None, rows: list[list[str]], styles: list[str],
                                                  width: int) -> None:
    # where it does not fit (narrow pages, long titles) QuickTable hands the table to rich: equal by construction
    table = _table(title, rows, styles)
    assert render_text([QuickTable(table)], width) == render_text([table], width)
    assert _styled([QuickTable(table)], width) == _styled([table], width)


def test_a_compact_table_is_laid_out_by_hand() -> None:
    # the hand layout is what runs (else the comparisons here would compare rich with rich), narrow pages included,
    # and for rich's default boxed table too; a table with a line between rows is rich's, and so is one squeezed
    # until a column has no room left
    table = _table("conversation c1", [["1", "09:11:06", "153 ms", "first_turn"]], [""])
    for width in (80, 30):  # (30: the verdict cut with an ellipsis)
        console = Console(width=width)
        assert not any(isinstance(part, Table) for part in QuickTable(table).__rich_console__(console,
                                                                                          console.options))
    squeezed = Console(width=12)
    assert any(isinstance(part, Table) for part in QuickTable(table).__rich_console__(squeezed, squeezed.options))
    boxed = Table("a", "b")
    boxed.add_row(Text("1"), Text("2"))
    console = Console(width=80)
    assert not any(isinstance(part, Table) for part in QuickTable(boxed).__rich_console__(console, console.options))
    lined = Table("a", "b", show_lines=True)
    lined.add_row(Text("1"), Text("2"))
    assert any(isinstance(part, Table) for part in QuickTable(lined).__rich_console__(console, console.options))


_ID = st.text(alphabet=st.sampled_from("abcdef0123456789-_:/é界 "), min_size=1, max_size=70)
_VERDICTS = st.lists(st.sampled_from(["first_turn", "remote_hit×4", "expired_remote_read", "metadata_not_returned*",
                                      "transfer_failed"]), min_size=1, max_size=9).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(_ID, st.integers(min_value=1, max_value=10**6), _VERDICTS), min_size=0, max_size=10),
       width=st.integers(min_value=20, max_value=160), title=st.sampled_from([None, "", "verdict counts",
                                                                               "36,311 conversations, worst first"]))
def test_a_table_whose_cells_wrap_reads_as_rich_lays_it_out(rows: list[tuple[str, int, str]], width: int,
                                                             title: str | None) -> None:
    # explain --all's table: ids and verdict runs fold or wrap when the page is too narrow for them
    table = compact_table(title)
    table.add_column("conversation", overflow="fold")
    table.add_column("turns", justify="right", no_wrap=True)
    table.add_column("verdicts", overflow="fold")
    for conversation, turns, verdicts in rows:
        table.add_row(Text(conversation), cell(f"{turns:,}", "red" if turns % 2 else ""), Text(verdicts))
    assert render_text([QuickTable(table)], width) == render_text([table], width)
    assert _styled([QuickTable(table)], width) == _styled([table], width)


# explain --all's rows as plain strings (no Text per cell): ids with control characters, NBSP, wide and combining
# characters, trailing spaces and tabs take the per-cell path, the others are one string a row
_PLAIN_ID = st.text(alphabet=st.sampled_from("abcdef0123456789-_:/é×界 \t\x1b\xa0\xad\u0301"), min_size=0, max_size=70)


def _plain_rows_table(rows: list[tuple[str, int, str]], title: str | None, turns_style: str
                      ) -> tuple[Table, QuickTable]:
    """The same rows in a rich table of Text cells, and in a QuickTable of plain rows."""
    def columns(table: Table) -> Table:
        table.add_column("conversation", overflow="fold")
        table.add_column("turns", justify="right", no_wrap=True)
        table.add_column("verdicts", overflow="fold")
        return table

    kinds = (Text(), cell("", turns_style), Text())
    rich_table = columns(compact_table(title))
    plain = [(conversation, f"{turns:,}", verdicts) for conversation, turns, verdicts in rows]
    for row in plain:
        rich_table.add_row(Text(row[0]), cell(row[1], turns_style), Text(row[2]))
    return rich_table, QuickTable(columns(compact_table(title)), plain, kinds)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(_PLAIN_ID, st.integers(min_value=1, max_value=10**6), _VERDICTS), min_size=0,
                     max_size=10),
       width=st.integers(min_value=20, max_value=160), title=st.sampled_from([None, "36,311 conversations"]),
       turns_style=st.sampled_from(["", "red"]))
def test_plain_rows_read_as_rich_lays_out_their_texts(rows: list[tuple[str, int, str]], width: int,
                                                      title: str | None, turns_style: str) -> None:
    rich_table, quick_table = _plain_rows_table(rows, title, turns_style)
    assert render_text([quick_table], width) == render_text([rich_table], width)
    assert _styled([quick_table], width) == _styled([rich_table], width)
    assert len(quick_table.table.rows) == len(rows)  # (rich's table, rows added, for whoever lays it out)


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.tuples(_PLAIN_ID, st.integers(min_value=1, max_value=10**6), _VERDICTS), min_size=0,
                     max_size=10),
       width=st.integers(min_value=12, max_value=160), title=st.sampled_from([None, "36311 conversations"]),
       turns_style=st.sampled_from(["", "red"]), plain=st.booleans())
def test_a_boxed_table_reads_as_rich_lays_it_out(rows: list[tuple[str, int, str]], width: int, title: str | None,
                                                 turns_style: str, plain: bool) -> None:
    # explain --all --wide's table: rich's default (heavy head, edges, padding on every side), its rows as Texts or
    # as plain strings
    def columns() -> Table:
        table = Table(title=title)
        table.add_column("conversation", overflow="fold")
        table.add_column("turns", justify="right", no_wrap=True)
        table.add_column("verdicts", overflow="fold")
        return table

    reference = columns()
    strings = [(conversation, str(turns), verdicts) for conversation, turns, verdicts in rows]
    for row in strings:
        reference.add_row(Text(row[0]), cell(row[1], turns_style), Text(row[2]))
    if plain:
        quick_table = QuickTable(columns(), strings, (Text(), cell("", turns_style), Text()))
    else:
        texts = columns()
        for row in strings:
            texts.add_row(Text(row[0]), cell(row[1], turns_style), Text(row[2]))
        quick_table = QuickTable(texts)
    assert render_text([quick_table], width) == render_text([reference], width)
    assert _styled([quick_table], width) == _styled([reference], width)
    ascii_out = []
    for part in (quick_table, reference):
        buf = _AsciiFile()
        Console(file=buf, width=width, color_system=None).print(part)
        ascii_out.append(buf.getvalue())
    assert ascii_out[0] == ascii_out[1]


def test_plain_rows_that_fit_are_one_string_each() -> None:
    # the fast path is what runs for rows that fit (the comparison above would otherwise compare rich with rich)
    _, quick_table = _plain_rows_table([("CONV_ID_1", 3, "first_turn remote_hit×2"), ("c2", 12, "first_turn")],
                                       "2 conversations", "")
    console = Console(width=80, color_system=None)
    parts = list(quick_table.__rich_console__(console, console.options))
    assert not any(isinstance(part, Table) for part in parts)
    rows = [p.text for p in parts if isinstance(p, Segment) and p.text.startswith(("CONV_ID_1", "c2 "))]
    assert rows == ["CONV_ID_1         3  first_turn remote_hit×2", "c2               12  first_turn             "]


def test_the_plain_rows_comparison_catches_a_row_taken_whole_that_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    # negative control: with the fit test broken, a row too wide for the page is printed whole, and the comparison
    # with rich's layout sees it
    rows = [("CONV_ID_1", 6, "first_turn transfer_failed metadata_not_returned router_entry_expired×2")]
    rich_table, quick_table = _plain_rows_table(rows, None, "")
    assert render_text([quick_table], 60) == render_text([rich_table], 60)
    monkeypatch.setattr(terminal_table, "_fits", lambda plain, cells, width: bool(plain))
    rich_table, quick_table = _plain_rows_table(rows, None, "")
    assert render_text([quick_table], 60) != render_text([rich_table], 60)


def test_plain_rows_need_a_template_per_column() -> None:
    table = compact_table("t")
    table.add_column("a")
    with pytest.raises(ValueError, match="template"):
        QuickTable(table, [("x",)], ())


def test_the_table_comparison_catches_a_wrong_justification() -> None:
    # negative control: the turn numbers justified left instead of right read differently, and the check sees it
    table = _table(None, [["7", "09:11:06", "153 ms", "first_turn"], ["12", "09:11:07", "1.2 s", "remote_hit"]],
                   ["", "green"])
    table.columns[0].justify = "left"
    wrong = render_text([QuickTable(table)], 80)
    table.columns[0].justify = "right"
    assert wrong != render_text([table], 80)


def test_the_terminal_benchmark_prints_the_same_views_both_ways(capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/terminal_bench.py, bounded: explain --all and a long conversation, each printed by rich's layout
    # and by kvdiag's; it stops with an error if the two texts differ
    spec = importlib.util.spec_from_file_location("terminal_bench", ROOT / "benchmarks" / "terminal_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["terminal_bench", "--conversations", "300", "--turns", "40", "--repeat", "1"])
    bench.main()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()][1:]
    assert [r["view"] for r in rows] == ["explain --all, 300 conversations", "explain --conversation, 40 turns"]
    assert all(r["lines"] > 40 and r["kvdiag_cpu_s"] >= 0 for r in rows)


class _AsciiFile(io.StringIO):
    encoding = "ascii"  # (a terminal that cannot show box characters: rich draws its tables in ASCII)


def test_an_ascii_terminal_gets_the_same_ascii_table() -> None:
    table = _table("conversation c1", [["1", "09:11:06", "153 ms", "first_turn"], ["2", "09:11:07", "-", "remote"]],
                   ["", "green"])
    outs = []
    for part in (QuickTable(table), table):
        buf = _AsciiFile()
        Console(file=buf, width=80, color_system=None).print(part)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    assert "|" in outs[0] and "─" not in outs[0]
