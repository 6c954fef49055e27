"""Internal: P's stats windows for the turns only they can decide, the engine's one Python step (windows.py).

The rules mark such turns (``wants_windows``); this step reads the lines the ledger needs (P's stat lines,
the proxy's offers, P's per-request lines), asks the ledger about each of those reads, and hands back its
findings as rows the rules read (``wfind``) and the text of the lines they cite (``wtext``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from typing import Final

from kvdiag.diagnostics.detect import LogFile, LogReadError
from kvdiag.diagnostics.engine_parse import sql_str
from kvdiag.diagnostics.engine_proxy import PROXY_GROUPS
from kvdiag.diagnostics.json_logs import EventRecord
from kvdiag.diagnostics.proxy_log_parser import ProxyRecord
from kvdiag.diagnostics.verdict_engine import Run, apply_windows, insert_rows
from kvdiag.diagnostics.vllm_log_parser import VllmRecord, parse_vllm_numbered
from kvdiag.diagnostics.window_load import _periodic, _probe, ledger_for_conversation, ledger_for_index
from kvdiag.diagnostics.windows import OFFER_KINDS, Ledger, LogIndex
from kvdiag.schema.events import TurnEvent


def _lines(run: Run, table: str, files: set[int], where: str = "true") -> dict[int, list[tuple[int, str]]]:
    out: dict[int, list[tuple[int, str]]] = defaultdict(list)
    if not files:
        return out
    rows = run.con.execute(f"SELECT f, n, line FROM {table} WHERE f IN ({', '.join(map(str, sorted(files)))}) "
                           f"AND line IS NOT NULL AND ({where}) ORDER BY f, n").fetchall()
    for f, n, line in rows:
        out[f].append((n, line))
    return out


def window_index(run: Run, proxy_kinds: Collection[str] | None = None) -> LogIndex:
    """The run's records as the ledger reads them (the proxy's lines as the engine classified them, of
    ``proxy_kinds`` only when given; the engines' kept lines, parsed by the Python parser; P's prefill events'
    outcomes)."""
    roles = dict(run.con.execute("SELECT f, role FROM froles").fetchall())
    index = LogIndex(file_roles={lf.path: roles.get(f) for f, lf in enumerate(run.files)},
                     formats={lf.path: lf.fmt for lf in run.files})
    p_files = {f for f, lf in enumerate(run.files) if lf.fmt == "vllm" and roles.get(f) == "prefill"}
    other_files = {f for f, lf in enumerate(run.files) if lf.fmt == "vllm"} - p_files
    index.proxy = proxy_records(run, proxy_kinds)
    # (of the other engines' lines the ledger reads one kind: D's word that P read blocks it had released)
    lines = {**_lines(run, "lines_vllm", p_files),
             **_lines(run, "lines_vllm", other_files, f"contains(line, {sql_str(D_LINES_READ)})")}
    for f, numbered in sorted(lines.items()):
        index.vllm.extend(parse_vllm_numbered(numbered, run.files[f].path))
    for f, n, ts, rid, outcome in run.con.execute(
            "SELECT f, n, ts, request_id, outcome FROM ev WHERE source = 'prefill' AND event = 'prefill_request' "
            "AND request_id IS NOT NULL ORDER BY f, n").fetchall():
        index.events.append(EventRecord(path=run.files[f].path, lineno=n, text="", event=TurnEvent(
            ts=ts, source="prefill", event="prefill_request", request_id=rid, outcome=outcome)))
    return index


# the start of the one kind of D's lines the ledger reads (vllm_log_parser's invalid_unrecognized)
D_LINES_READ: Final = "Potentially invalid KV blocks for unrecognized request"


def proxy_records(run: Run, kinds: Collection[str] | None = None) -> list[ProxyRecord]:
    """The proxy's lines the engine classified (``pl``: the parser's kinds and groups), of ``kinds`` when given,
    as the parser's records, in file and line order: reading them again in Python cost as much as the rest of
    the windows' work."""
    paths = {f: lf.path for f, lf in enumerate(run.files)}
    groups = ", ".join(f"p.{g}" for g in PROXY_GROUPS)
    only = "" if kinds is None else f"WHERE p.kind IN ({', '.join(sql_str(k) for k in sorted(kinds))})"
    rows = run.con.execute(f"""SELECT p.f, p.n, p.ts, p.kind, left(rtrim(l.line, chr(13) || chr(10)), 500), {groups}
        FROM pl p JOIN lines_proxy l USING (f, n) {only} ORDER BY p.f, p.n""").fetchall()
    out = []
    for f, n, ts, kind, text, *values in rows:
        # the level as PROXY_RE reads it: the first "[...]" after the time stamp (which holds no "[")
        level = text.partition(" [")[2].partition("]")[0]
        out.append(ProxyRecord(path=paths[f], lineno=n, ts=ts, level=level, kind=kind, text=text,
                               fields={g: v for g, v in zip(PROXY_GROUPS, values, strict=True) if v is not None}))
    return out


def decide_windows(run: Run, wanted: Sequence[str], *, one: bool) -> None:
    """Read P's stats windows for the ``wanted`` requests' reads and decide those turns again."""
    if not one and not _periodic_stats(run):
        return  # stat lines several a second mark no windows (docs/verdicts.md)
    # (every proxy record for one conversation: the times of its requests' lines bound what is read around them;
    # for every conversation only those the ledger reads, and the first proxy time it takes from the others)
    index = window_index(run, None if one else OFFER_KINDS)
    try:
        ledger = (ledger_for_conversation(run.files, index, set(wanted)) if one
                  else ledger_for_index(index, _first_proxy_time(run)))
    except (LogReadError, OSError, EOFError) as exc:
        raise LogReadError(str(exc)) from None
    if ledger is None:
        return
    rows, texts = findings(ledger, wanted, run.files)
    insert_rows(run.con, "wtext", ("BIGINT", "VARCHAR", "VARCHAR"), texts)
    apply_windows(run, rows)


# proxy_log_parser.wall_clock in SQL: the day read as a calendar date (NULL when it is none), then the clock
PROXY_WALL_CLOCK: Final = ("epoch(TRY_CAST(left(ts, 10) AS DATE)) + TRY_CAST(substr(ts, 12, 2) AS INTEGER) * 3600 "
                           "+ TRY_CAST(substr(ts, 15, 2) AS INTEGER) * 60 + TRY_CAST(substr(ts, 18, 2) AS INTEGER)")


def _first_proxy_time(run: Run) -> float | None:
    """The earliest time among the proxy's classified lines (wall_clock's reading, in SQL)."""
    row = run.con.execute(f"SELECT min({PROXY_WALL_CLOCK}) FROM pl").fetchall()
    return None if not row or row[0][0] is None else float(row[0][0])


# The offers' clock times sorted, the one at index count // 2 (NULL without one). One pass: each time is read once
# (an ORDER BY ... OFFSET over a CTE counted in a subquery read every line's clock twice, twice as long).
MIDDLE_OFFER_SQL: Final = (f"SELECT list_sort(list(t) FILTER (WHERE t IS NOT NULL))[count(t) // 2 + 1] "
                           f"FROM (SELECT {PROXY_WALL_CLOCK} AS t FROM pl WHERE kind = 'sending')")


def _periodic_stats(run: Run) -> bool:
    """P's stat lines around the middle offer are periodic (a bisected look at each P log, before any parsing)."""
    # the middle offer's time (wall_clock's reading of the proxy's clock, in SQL: only one value is needed)
    middle = run.con.execute(MIDDLE_OFFER_SQL).fetchall()[0][0]
    if middle is None:
        return False
    p_files = [lf.path for lf, (role,) in zip(run.files, run.con.execute(
        "SELECT role FROM froles ORDER BY f").fetchall(), strict=True) if lf.fmt == "vllm" and role == "prefill"]
    return all(_periodic(_probe(path, float(middle))) for path in p_files)


def findings(ledger: Ledger, wanted: Sequence[str], files: list[LogFile]
             ) -> tuple[list[tuple[object, ...]], list[tuple[int, str, str]]]:
    """The ledger's word on each wanted read, as ``wfind`` rows, and the cited lines' (ref, source, text)."""
    f_of = {lf.path: f for f, lf in enumerate(files)}
    texts: dict[int, tuple[int, str, str]] = {}

    def ref(rec: VllmRecord | ProxyRecord | None) -> int | None:
        if rec is None or rec.path not in f_of:
            return None
        key = (f_of[rec.path] << 40) + rec.lineno
        texts[key] = (key, rec.source, rec.text[:300])
        return key

    rows: list[tuple[object, ...]] = []
    caching = ref(ledger.caching_line)
    for rid in wanted:
        found = ledger.finding(rid)
        if found is None:
            rows.append((rid, False, None, None, [], None, None, ledger.recovered_near(rid) is not None, caching))
            continue
        refs = [r for r in (ref(w.evidence) for w in found.windows) if r is not None]
        rows.append((rid, True, found.read, found.why, refs, ref(found.rejected), found.prefix_caching,
                     ledger.recovered_near(rid) is not None, caching))
    return rows, list(texts.values())
