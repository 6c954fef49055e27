"""The texts of the lines a turn's evidence cites, as explain prints them: ``file:line`` and the text (at most 300
characters).

A ref, ``(f << 40) + n`` (engine_facts), takes the first text of: its event's own (``ev``: the odd JSON lines
Python parsed), its client statistic's (``cs``), its vLLM line rebuilt from the parsed header (``vl_head``), its
JSON line (trimmed as Python's str.strip()), its proxy line (less a trailing CR), a stats window's (``wtext``).

Each table is read only for the files it holds rows (that can answer) of and some ref names, and there only for
the rows cited: a semi join on the refs, so the hash table holds the refs, never the tables' long lines, and no
table is joined for refs it has no row of. Files only one table answers for, as logs are (a JSON log's lines in
``lines_json``, a vLLM log's in ``vl_head``), need no ranking of the tables' texts. (Every text is cut straight
to 300 characters: the 500 a record keeps of its line would be cut the same.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from kvdiag.diagnostics.engine_parse import VLLM_LINE, VLLM_LINE_OK

if TYPE_CHECKING:
    import duckdb

_WS: Final = "' \t\r\n\x0b\x0c'"  # what Python's str.strip() removes from a JSON line (ASCII)
_CUT: Final = 300  # characters of a text explain prints

# In the order of the texts' precedence: (table, the condition on its rows that can answer, the rows (f, n, text)
# for the refs of the files in {files}; {cited} tells a cited row). No text is NULL: each condition is on the
# table's columns (a filter on the text would be pushed into the projection and compute each text twice).
_SOURCES: Final = (
    # (the events of a line read as a JSON array share its text)
    ("ev", "text IS NOT NULL",
     f"SELECT f, n, left(any_value(text), {_CUT}) AS text FROM ev WHERE text IS NOT NULL AND {{files}} AND {{cited}} "
     "GROUP BY f, n"),
    # (a line's statistics share its text: the last one's, as the facts take it)
    ("cs", "text IS NOT NULL",
     f"SELECT * FROM (SELECT f, n, left(arg_max(text, sub), {_CUT}) AS text FROM cs WHERE {{files}} AND {{cited}} "
     "GROUP BY f, n) WHERE text IS NOT NULL"),
    ("vl_head", VLLM_LINE_OK,
     f"SELECT f, n, left({VLLM_LINE}, {_CUT}) AS text FROM vl_head h WHERE {VLLM_LINE_OK} AND {{files}} AND {{cited}}"),
    ("lines_json", "line IS NOT NULL",
     f"SELECT f, n, left(CASE WHEN starts_with(line, '{{{{') AND ends_with(line, '}}}}') THEN line ELSE trim(line, "
     f"{_WS}) END, {_CUT}) AS text FROM lines_json WHERE line IS NOT NULL AND {{files}} AND {{cited}}"),
    ("lines_proxy", "line IS NOT NULL",
     f"SELECT f, n, left(CASE WHEN ends_with(line, chr(13)) THEN rtrim(line, chr(13)) ELSE line END, {_CUT}) AS text "
     "FROM lines_proxy WHERE line IS NOT NULL AND {files} AND {cited}"),
)
_EMPTY: Final = "SELECT NULL::BIGINT AS ref, NULL::VARCHAR AS source, NULL::VARCHAR AS text WHERE false"


def evidence_texts_sql(con: duckdb.DuckDBPyConnection, refs: str) -> str:
    """SELECT (ref, source, text), one row per ref of table ``refs`` (column ``ref``) that has a text."""
    cited_files = {f for (f,) in con.execute(f"SELECT DISTINCT (ref >> 40)::INTEGER FROM {refs}").fetchall()}
    held = " UNION ALL ".join(f"SELECT DISTINCT {k} AS k, f FROM {table} h WHERE {answers}"
                              for k, (table, answers, _) in enumerate(_SOURCES))
    files: dict[int, list[int]] = {}
    for k, f in con.execute(held).fetchall():
        if f in cited_files:
            files.setdefault(k, []).append(f)
    cited = f"((f::BIGINT << 40) + n) IN (SELECT ref FROM {refs})"
    parts = [_SOURCES[k][2].format(files=f"f IN ({', '.join(map(str, sorted(fs)))})", cited=cited)
             for k, fs in sorted(files.items())]
    windows = bool(con.execute("SELECT count(*) FROM wtext").fetchall()[0][0])
    if not parts and not windows:
        return _EMPTY
    source = "fl.path || ':' || t.n"
    # ranked: some two tables answer for a file (a window's line always comes after the log's text of the line)
    ranked = windows or sum(map(len, files.values())) > len({f for fs in files.values() for f in fs})
    if ranked:
        extra = ", NULL::VARCHAR AS source" if windows else ""
        parts = [f"SELECT {k} AS k, *{extra} FROM ({q})" for k, q in enumerate(parts)]
    if windows:  # (its own source and text)
        parts.append(f"SELECT {len(parts)} AS k, (ref >> 40)::INTEGER AS f, ref & ((1::BIGINT << 40) - 1) AS n, "
                     f"left(text, {_CUT}) AS text, source FROM wtext")
        source = f"coalesce(t.source, {source})"
    texts = " UNION ALL ".join(parts)
    if ranked:
        texts = f"SELECT DISTINCT ON (f, n) * EXCLUDE (k) FROM ({texts}) ORDER BY f, n, k"
    return f"""SELECT (t.f::BIGINT << 40) + t.n AS ref, {source} AS source, t.text FROM ({texts}) t
        JOIN files fl USING (f)"""
