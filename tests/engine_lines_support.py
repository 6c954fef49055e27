"""Put numbered lines into one of the engine's line tables, as the engine's loader does."""

from __future__ import annotations

from collections.abc import Iterable

import duckdb

from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics.linestats import LineStats


def insert_lines(con: duckdb.DuckDBPyConnection, table: str, numbered: Iterable[tuple[int, bytes | str]], path: str,
                 *, f: int = 0) -> None:
    """Insert ``numbered`` (line number, text) as file ``f``'s lines into ``table`` (e.g. ``lines_proxy``)."""
    lines, _notes = ep.lines_arrow(f, numbered, LineStats(), path, json=table == "lines_json")
    con.register("new_lines", lines)
    con.execute(f"INSERT INTO {table} SELECT * FROM new_lines")
    con.unregister("new_lines")
