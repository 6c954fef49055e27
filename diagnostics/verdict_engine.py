"""The verdict engine: log lines in, one row per turn out (verdict, confidence, reason, evidence, numbers).

One pipeline in DuckDB for every path (explain for one conversation, explain ``--all``, report, advise):

    lines ──► engine_parse (records) ──► engine_join (turns) ──► engine_facts (facts) ──► rules.RULES

Whole files are read by DuckDB; vLLM logs through a prefilter (grep: only lines whose message can be a
kind the rules read); one conversation's lines through the id prefilters explain.py runs. Turns that only
P's stats windows can decide get them from windows.py (a Python ledger over P's stat lines), and the
rules run again with its findings. Python does only what parsing needs: lines DuckDB cannot split the way
grep does, odd JSON lines, and the windows.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from kvdiag.diagnostics import duckdb_api
from kvdiag.diagnostics import engine_json_records as jr
from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics.detect import LogFile, LogReadError, open_binary
from kvdiag.diagnostics.engine_evidence import evidence_texts_sql
from kvdiag.diagnostics.engine_facts import facts_sql
from kvdiag.diagnostics.engine_join import BulkOnly, FewRowsOnly, join_sql
from kvdiag.diagnostics.engine_no_events import EventsOnly, EventsUnion, branch_statements, stand_in
from kvdiag.diagnostics.engine_proxy import line_order
from kvdiag.diagnostics.linestats import MAX_LINE_CHARS, LineStats
from kvdiag.diagnostics.rules import DEFAULT_BLOCK_SIZE, decide_sql, pick_sql
from kvdiag.diagnostics.scan import (
    GREP,
    RG_FIELD_SEPARATOR,
    grep_ere,
    grep_ere_to_file,
    grep_regex,
    is_events_document,
    is_stats_document,
    ripgrep,
    rust_escape,
)
from kvdiag.schema.errors import KVDiagError

if TYPE_CHECKING:  # numpy and pyarrow are imported where used: one conversation never needs them
    import duckdb
    import pyarrow as pa

# vLLM lines the rules can read, by their message's first letters (after the header's "] "); grep keeps them
# at C speed and numbers them as the engine does (by "\n").
VLLM_MESSAGE_STARTS: Final = ("Bidirectional KV transfer", "Declining expired", "Releasing expired",
                              "Potentially invalid", "NIXL", "Failing", "Recovered from", "Skipping", "start_load_kv",
                              "Remote agent", "Finished", "Got ", "Generated response", "Aborted request", "Request ",
                              "Received request", "Added request", "chatcmpl-", "cmpl-")
# (vLLM's colours, when its output was a terminal, may stand between the header and the message)
VLLM_PREFILTER: Final = ("\\](\x1b\\[[0-9;]*m)* ("
                         + "|".join(re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", s) for s in VLLM_MESSAGE_STARTS) + ")")
# the same lines as a Perl pattern (grep -P finds them several times faster when nothing else is searched for)
VLLM_PREFILTER_PCRE: Final = ("\\](?:\x1b\\[[0-9;]*m)* (?:" + "|".join(re.escape(s) for s in VLLM_MESSAGE_STARTS)
                              + ")")
# and in rg's syntax (rg runs it first where it is installed: several times faster than grep on these logs)
VLLM_PREFILTER_RUST: Final = ("\\](?:\\x1b\\[[0-9;]*m)* (?:" + "|".join(rust_escape(s) for s in VLLM_MESSAGE_STARTS)
                              + ")")
_PREFILTER_BYTES: Final = re.compile(VLLM_PREFILTER.encode())
_JSON_FORMATS: Final = ("events", "client_stats")
_TABLES: Final = {"events": "lines_json", "client_stats": "lines_json", "proxy": "lines_proxy", "vllm": "lines_vllm"}


class EngineError(KVDiagError):
    """The inputs cannot be read; the message names the file."""


@dataclass
class Run:
    """One engine run's DuckDB connection and what it read."""

    files: list[LogFile]
    con: duckdb.DuckDBPyConnection
    stats: LineStats = field(default_factory=LineStats)
    only: str | None = None
    evidence: bool = True  # each turn's evidence refs (explain prints them; the turn table reads none)
    timings: list[tuple[str, float, float]] = field(default_factory=list)  # KVDIAG_PROFILE: (statement, wall, cpu)
    # vLLM and proxy lines containing one of these strings are also kept in the table side_rows (line number and
    # text, as grep gives them), whatever the prefilter says; the same reads find them, so the configuration scan
    # needs no second pass over the logs. side_markers: the files that have their side lines there (a file read
    # neither way has no entry), with the needles those lines hold; marker_lines reads them.
    side_needles: tuple[str, ...] = ()
    side_markers: dict[int, tuple[str, ...]] = field(default_factory=dict)
    few_rows: bool = False  # set by use_few_rows
    documents: bool = False  # add_document wrote cs_doc (a catalog lookup costs a conversation's run 11 ms)
    document_events: list[tuple[object, ...]] = field(default_factory=list)  # add_event_document's (EV_ROW_COLUMNS)
    # the event fields some event line sets (parse learns them; the others are NULL in every event)
    event_columns: frozenset[str] | None = None

    @property
    def merged_proxy_logs(self) -> bool:
        """Several proxy logs (a router's replicas): their lines are ordered by time, not log after log."""
        return sum(lf.fmt == "proxy" for lf in self.files) > 1

    @property
    def paths(self) -> dict[int, str]:
        """File index -> path."""
        return {f: lf.path for f, lf in enumerate(self.files)}


def execute(run: Run, sql: str) -> None:
    """Run one statement; with KVDIAG_PROFILE set, its wall and CPU seconds go to ``run.timings``."""
    if not PROFILE:
        run.con.execute(sql)
        return
    w, c = time.perf_counter(), time.process_time()
    run.con.execute(sql)
    run.timings.append((" ".join(sql.split())[:60], time.perf_counter() - w, time.process_time() - c))


PROFILE: Final = bool(os.environ.get("KVDIAG_PROFILE"))


# DuckDB's own default (80% of RAM) lets a 10 GB run hold every line in memory; past this limit it spills
# to a temporary directory instead, so memory stays bounded whatever the logs' size.
MAX_MEMORY_LIMIT: Final = 3 << 30


def memory_limit() -> str:
    """The run's DuckDB memory limit: KVDIAG_MEMORY_LIMIT, else a quarter of RAM up to 3 GiB."""
    limit = os.environ.get("KVDIAG_MEMORY_LIMIT")
    if limit:
        return limit
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 4 * MAX_MEMORY_LIMIT
    return f"{max(min(ram // 4, MAX_MEMORY_LIMIT), 256 << 20) >> 20}MiB"


def connect() -> duckdb.DuckDBPyConnection:
    """A DuckDB connection for one run (memory bounded: it spills to disk past the limit)."""
    con = duckdb_api.connect(config={"preserve_insertion_order": True})
    con.execute(f"SET memory_limit = {ep.sql_str(memory_limit())}")
    # DuckDB would spill into ./.tmp; its own directory under the system's temp dir (DuckDB removes it on close)
    spill = os.path.join(tempfile.gettempdir(), f"kvdiag-duckdb-{os.getpid()}-{id(con):x}")
    con.execute(f"SET temp_directory = {ep.sql_str(spill)}")
    con.execute("SET arrow_large_buffer_size = true")
    return con


def new_run(files: list[LogFile], only: str | None = None) -> Run:
    """A run over ``files`` (detect()'s order is the reading order)."""
    con = connect()
    ep.create_line_tables(con)
    con.execute("CREATE TEMP TABLE files (f INTEGER, path VARCHAR, fmt VARCHAR, role VARCHAR)")
    # (one statement: executemany runs one per file, 4 ms for seven)
    insert_rows(con, "files", ("INTEGER", "VARCHAR", "VARCHAR", "VARCHAR"),
                [(f, lf.path, lf.fmt, lf.role) for f, lf in enumerate(files)])
    return Run(files=files, con=con, only=only)


def add_lines(run: Run, f: int, numbered: Iterable[tuple[int, bytes | str]]) -> None:
    """Lines of file ``f`` that Python read (a prefilter's, a compressed file's)."""
    lf = run.files[f]
    json = lf.fmt in _JSON_FORMATS
    if not isinstance(numbered, list):  # (a reader's lines: a few go in as lists, the rest through Arrow)
        head = list(itertools.islice(numbered, SMALL_INSERT_ROWS + 1))
        numbered = head if len(head) <= SMALL_INSERT_ROWS else itertools.chain(head, numbered)
    if isinstance(numbered, list) and len(numbered) <= SMALL_INSERT_ROWS:
        ns, texts, notes = ep.decoded_lines(f, numbered, run.stats, lf.path, json=json)
        if ns:
            run.con.execute(f"INSERT INTO {_TABLES[lf.fmt]} SELECT {f}, unnest($n), unnest($line)",
                            {"n": ns, "line": texts})
    else:
        table, notes = ep.lines_arrow(f, numbered, run.stats, lf.path, json=json)
        _insert(run.con, _TABLES[lf.fmt], table)
    if notes:
        run.con.executemany("INSERT INTO notes VALUES (?, ?, ?)", notes)


# Up to this many lines (one conversation's) go in as list parameters: building Arrow arrays from Python
# lists makes pyarrow import pandas (0.25 s, several times what inserting them costs).
SMALL_INSERT_ROWS: Final = 20_000


def _insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
    name = f"new_{table}"
    duckdb_api.with_python_layer()  # (it registers Arrow tables)
    con.register(name, rows)
    try:
        con.execute(f"INSERT INTO {table} SELECT * FROM {name}")
    finally:
        con.unregister(name)


def _plain(path: str) -> Literal["plain", "delimiter", "other"]:
    """"plain" when DuckDB can read the file line for line as grep numbers it: not compressed, no carriage
    return (DuckDB also ends a line at a lone CR), no byte 0x01 (its line reader's column delimiter, where it
    would cut the line); "delimiter" when only a byte 0x01 stands in the way; "other" otherwise."""
    if path.endswith(".gz"):
        return "other"
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return "plain"
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if mm[:2] == b"\x1f\x8b" or mm.find(b"\r") >= 0:
                    return "other"
                return "plain" if mm.find(b"\x01") < 0 else "delimiter"
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_all_lines(path: str, progress: Callable[[int], None] | None = None) -> Iterator[tuple[int, bytes]]:
    """Every line with its number, split at ``\\n`` only (the file's last line counts without one)."""
    lineno = 0
    tail = b""
    try:
        with open_binary(path) as fh:
            while block := fh.read(8 << 20):
                if progress is not None:
                    progress(len(block))
                parts = (tail + block).split(b"\n")
                tail = parts.pop()
                for line in parts:
                    lineno += 1
                    yield lineno, line
    except (OSError, EOFError) as exc:
        raise LogReadError(f"cannot read {path}: {exc}") from None
    if tail:
        yield lineno + 1, tail


def vllm_lines(path: str, progress: Callable[[int], None] | None = None) -> Iterator[tuple[int, bytes]]:
    """The lines of a vLLM log the rules can read (VLLM_PREFILTER), numbered."""
    if GREP is not None and not path.endswith(".gz"):
        yield from grep_ere(path, VLLM_PREFILTER, progress)
        return
    yield from grep_regex(path, _PREFILTER_BYTES, progress)


def _grep_vllm(path: str, progress: Callable[[int], None] | None, also: Sequence[str] = ()
               ) -> tuple[str, bytes] | list[tuple[int, bytes]]:
    """The prefilter's lines of one vLLM log (and those containing a string of ``also``): a file of grep's
    output (DuckDB reads it) and the separator after each line's number, or the prefilter's numbered lines when
    grep cannot run on it (no grep, a compressed file)."""
    if (GREP is None and ripgrep() is None) or path.endswith(".gz"):
        return list(vllm_lines(path, progress))
    fd, out = tempfile.mkstemp(prefix="kvdiag-vllm-", suffix=".txt")
    os.close(fd)
    try:
        sep = grep_ere_to_file(path, VLLM_PREFILTER, out, progress, also, pcre=VLLM_PREFILTER_PCRE,
                               rust=VLLM_PREFILTER_RUST)
    except BaseException:
        os.unlink(out)
        raise
    return out, sep


def _csv_safe(path: str, sep: bytes) -> bool:
    """True when DuckDB's line reader splits ``path`` as grep numbered it: no carriage return (a line end
    for DuckDB), no NUL, and no byte 0x01 (the reader's column delimiter) unless it is the separator (a line
    holding one more is an error for the strict two-column read)."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return all(mm.find(b) < 0 for b in (b"\r", b"\x00", b"\x01") if b != sep)


def _numbered(path: str, sep: bytes) -> Iterator[tuple[int, bytes]]:
    """grep's "N<sep>line" output read back by Python (each line with its newline, as grep's pipe gives it)."""
    for _n, raw in read_all_lines(path):
        num, _, line = raw.partition(sep)
        yield int(num), line + b"\n"


def add_grep_output(run: Run, f: int, path: str, sep: bytes) -> None:
    """grep's "N<sep>line" output for file ``f`` into its lines table: read by DuckDB where it splits the lines
    as grep did and every line is valid UTF-8 and short enough to keep whole; by Python (add_lines, which
    counts and notes such lines) otherwise. Lines with a side needle are kept in side_rows; those the
    prefilter would not keep leave the lines table."""
    if os.path.getsize(path) == 0:
        if run.side_needles:
            _keep_side_lines(run, f, [])
        return
    table = _TABLES[run.files[f].fmt]
    if _csv_safe(path, sep):
        try:
            if sep == RG_FIELD_SEPARATOR:  # (the reader splits the number off: 0x01 is its delimiter)
                run.con.execute(f"INSERT INTO {table} SELECT {f}, n, coalesce(line, '') "
                                f"FROM read_csv({ep.sql_str(path)}, {ep.CSV_NUMBERED_LINES})")
            else:
                # (the number ends at the first ":": split_part would split the whole line at every one. The
                # lines are stored before they are cut: DuckDB then knows whether they are ASCII, and cuts ASCII
                # text by byte position instead of counting its characters from the start)
                run.con.execute(f"CREATE OR REPLACE TEMP TABLE grep_lines AS SELECT line FROM "
                                f"read_csv({ep.sql_str(path)}, {ep.CSV_LINES})")
                try:
                    run.con.execute(f"INSERT INTO {table} SELECT {f}, CAST(left(line, c - 1) AS BIGINT), "
                                    "substr(line, c + 1) FROM (SELECT line, strpos(line, ':') AS c FROM grep_lines)")
                finally:
                    run.con.execute("DROP TABLE grep_lines")
            # (decode_line keeps a line whole up to MAX_LINE_CHARS bytes, its newline included)
            if not run.con.execute(f"SELECT count(*) FROM {table} WHERE f = {f} AND strlen(line) >= "
                                   f"{MAX_LINE_CHARS}").fetchall()[0][0]:
                _split_side_lines(run, f, table)
                return
        except (duckdb_api.InvalidInputException, duckdb_api.ConversionException):
            pass
        run.con.execute(f"DELETE FROM {table} WHERE f = {f}")
        if run.side_markers.pop(f, None) is not None:  # (Python reads the file again, side lines included)
            run.con.execute(f"DELETE FROM side_rows WHERE f = {f}")
    numbered = _numbered(path, sep)
    if not run.side_needles:
        add_lines(run, f, numbered)
        return
    side: list[tuple[int, str]] = []
    add_lines(run, f, _side_filtered(run, numbered, side))
    _keep_side_lines(run, f, side)


def _split_side_lines(run: Run, f: int, table: str) -> None:
    """The side needles' lines of file ``f`` (in its lines table, valid UTF-8) kept in side_rows; the ones the
    prefilter does not keep are deleted from the lines table."""
    if not run.side_needles:
        return
    _keep_side_lines(run, f, table)
    run.con.execute(f"DELETE FROM {table} WHERE f = {f} AND n IN (SELECT n FROM side_rows WHERE f = {f} AND NOT "
                    f"regexp_matches(line, {ep.sql_str(VLLM_PREFILTER)}))")


def _keep_side_lines(run: Run, f: int, lines: str | Sequence[tuple[int, str]]) -> None:
    """File ``f``'s side lines into side_rows: from its lines table (``lines`` names it: whole, valid UTF-8,
    numbered as grep numbers them) or as Python read them; noted in ``run.side_markers`` with the needles they
    hold."""
    run.con.execute("CREATE TEMP TABLE IF NOT EXISTS side_rows (f INTEGER, n BIGINT, line VARCHAR)")
    if isinstance(lines, str):
        found = " OR ".join(f"contains(line, {ep.sql_str(s)})" for s in run.side_needles)
        run.con.execute(f"INSERT INTO side_rows SELECT f, n, line FROM {lines} WHERE f = {f} AND ({found})")
    else:
        insert_rows(run.con, "side_rows", ("INTEGER", "BIGINT", "VARCHAR"), [(f, n, text) for n, text in lines])
    held = ", ".join(f"bool_or(contains(line, {ep.sql_str(s)}))" for s in run.side_needles)
    flags = run.con.execute(f"SELECT {held} FROM side_rows WHERE f = {f}").fetchall()[0]
    run.side_markers[f] = tuple(s for s, hit in zip(run.side_needles, flags, strict=True) if hit)


def marker_lines(run: Run, f: int) -> Iterator[tuple[int, str]]:
    """The side lines of file ``f``, in order, read a page at a time (a reader that stops at the first few
    reads only those)."""
    last, page = 0, 256
    while True:
        rows: list[tuple[int, str]] = run.con.execute(
            f"SELECT n, line FROM side_rows WHERE f = {f} AND n > {last} ORDER BY n LIMIT {page}").fetchall()
        yield from rows
        if len(rows) < page:
            return
        last, page = rows[-1][0], min(page * 4, 1 << 16)


def _side_filtered(run: Run, numbered: Iterable[tuple[int, bytes]], side: list[tuple[int, str]]
                   ) -> Iterator[tuple[int, bytes]]:
    """``numbered`` without the lines only a side needle kept; those with a side needle into ``side``
    (decoded as the configuration scan decodes grep's lines)."""
    needles = [s.encode() for s in run.side_needles]
    for n, raw in numbered:
        if any(s in raw for s in needles):
            side.append((n, raw.decode("utf-8", errors="replace").rstrip("\r\n")))
            if not _PREFILTER_BYTES.search(raw):
                continue
        yield n, raw


def load_files(run: Run, progress: Callable[[int], None] | None = None) -> None:
    """Every input line into the lines tables: whole JSON and proxy files by DuckDB (Python where it cannot),
    vLLM logs through the prefilter (grep, beside DuckDB's scans, into a file DuckDB reads)."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - with logging, 5 ms one conversation skips

    engine_logs = [f for f, lf in enumerate(run.files) if lf.fmt == "vllm"]
    with ThreadPoolExecutor(max_workers=max(1, min(len(engine_logs), 4))) as pool:
        kept = {f: pool.submit(_grep_vllm, run.files[f].path, progress, run.side_needles) for f in engine_logs}
        try:
            for f, lf in enumerate(run.files):
                if lf.fmt in ("unknown", "vllm"):
                    if lf.fmt == "unknown":
                        run.stats.unrecognised_files.append(lf.path)
                        if progress is not None:
                            progress(lf.size)
                    continue
                if is_stats_document(lf):
                    jr.add_document(run, f)
                    continue
                if is_events_document(lf) and jr.add_event_document(run, f):
                    if progress is not None:
                        progress(lf.size)
                    continue
                plain = _plain(lf.path)
                if plain == "plain":
                    try:
                        run.con.execute(ep.read_lines_sql(_TABLES[lf.fmt], f, lf.path))
                        if lf.fmt == "proxy" and run.side_needles:
                            _keep_side_lines(run, f, _TABLES[lf.fmt])
                        if progress is not None:
                            progress(lf.size)
                        continue
                    except (duckdb_api.InvalidInputException, duckdb_api.ConversionException):
                        # invalid UTF-8: Python decodes
                        run.con.execute(f"DELETE FROM {_TABLES[lf.fmt]} WHERE f = {f}")
                corrupt = run.stats.corrupt
                add_lines(run, f, read_all_lines(lf.path, progress))
                # (a line holding the reader's delimiter, read by Python, is as the file has it: its side lines
                # are kept as a plain file's are, unless some line did not decode)
                if plain == "delimiter" and run.stats.corrupt == corrupt and lf.fmt == "proxy" and run.side_needles:
                    _keep_side_lines(run, f, _TABLES[lf.fmt])
            for f, fut in kept.items():
                try:
                    got = fut.result()
                    if isinstance(got, tuple):
                        add_grep_output(run, f, *got)
                    else:
                        add_lines(run, f, got)
                except (OSError, EOFError) as exc:
                    raise LogReadError(f"cannot read {run.files[f].path}: {exc}") from None
        finally:
            for fut in kept.values():  # every grep output file goes, whatever failed
                try:
                    got = fut.result()
                except BaseException:  # reported above (or the failure in progress is)
                    continue
                if isinstance(got, tuple):
                    with contextlib.suppress(OSError):
                        os.unlink(got[0])


def parse(run: Run) -> None:
    """Lines into record tables (engine_parse), odd JSON lines through json_logs."""
    # (every vLLM line ASCII: each pattern as written, no Unicode-aware form to compile or test per line)
    counted = f"SELECT count(*), bool_and({ep.ASCII.format('line')}) FROM lines_vllm"
    lines, ascii = run.con.execute(counted).fetchall()[0]
    many, all_ascii = lines >= ep.ASCII_BRANCH_MIN_LINES, bool(ascii)
    stats = any(lf.fmt == "client_stats" for lf in run.files)
    for q in ep.parse_json_sql(stats=stats):
        execute(run, q)
    merged = run.merged_proxy_logs
    if run.few_rows:  # (only the proxy classifiers one of the lines can match; RE2 compiles each at every run)
        proxy_sql = ep.parse_proxy_sql((ln for (ln,) in run.con.execute(
            "SELECT line FROM lines_proxy WHERE line IS NOT NULL").fetchall()), merged=merged)
    else:  # (every line ASCII: RE2 runs the patterns' ASCII forms faster than their Unicode classes)
        proxy_ascii, proxy_cr = run.con.execute(f"SELECT bool_and({ep.ASCII.format('line')}), "
                                                "bool_or(ends_with(line, chr(13))) FROM lines_proxy").fetchall()[0]
        proxy_sql = ep.parse_proxy_sql(all_ascii=bool(proxy_ascii), cr=bool(proxy_cr), merged=merged)
    fields = ep.event_fields(run.con)
    for q in ep.parse_events_sql(fields, stats=stats):
        execute(run, q)
    # Each table is dropped once nothing reads it (only an evidence text reads a JSON line or a vLLM header
    # again): the statements after it reuse its memory, where a fresh process would fault in new pages (the
    # kernel's share is about a fifth of a run's CPU).
    if not run.evidence:
        run.con.execute("DROP TABLE lines_json")
    for q in proxy_sql:
        execute(run, q)
    if not run.few_rows:
        for q in ep.vllm_head_sql(ascii_branch=many, all_ascii=all_ascii):
            execute(run, q)
    else:
        ep.vllm_head_few_lines(run.con, lambda q: execute(run, q), ascii_branch=many, all_ascii=all_ascii)
    run.con.execute("DROP TABLE vl_clean")
    # only the classifiers of the first words the messages have (the others' patterns cannot match)
    words = [w for (w,) in run.con.execute("SELECT DISTINCT w FROM vl_head").fetchall()]
    execute(run, ep.vllm_records_sql(words, ascii_branch=many, all_ascii=all_ascii))
    if not run.evidence:
        run.con.execute("DROP TABLE vl_head")
    if run.documents:
        run.con.execute("INSERT INTO cs SELECT * FROM cs_doc")
    run.event_columns = frozenset((*fields, *jr.read_odd_json(run.con, run.paths, run.stats),
                                   *jr.append_events(run.con, run.document_events)))


def views_sql(merged: bool) -> str:
    """The views the facts and rules read; ``merged``: several proxy logs, pl's ``po`` orders their lines."""
    return f"""CREATE TEMP VIEW vl_r AS SELECT vl.*, fr.role FROM vl JOIN froles fr USING (f);
CREATE TEMP VIEW ready AS SELECT f, n, seq, {line_order(merged)} AS po FROM pl WHERE kind = 'ready';
CREATE TEMP TABLE wtext (ref BIGINT, source VARCHAR, text VARCHAR)"""
# (each source read once, its facts as aggregates: a scalar subquery per fact bound and scanned the views again)
CONTEXT_SQL: Final = f"""CREATE TEMP TABLE ctx AS
WITH fl AS (SELECT bool_or(fmt = 'client_stats') AS stats_file, bool_or(fmt = 'proxy') AS proxy_file FROM files),
fr AS (SELECT bool_or(fmt = 'vllm' AND role = 'prefill') AS p_file, bool_or(fmt = 'vllm' AND role = 'decode') AS d_file
       FROM froles),
e AS (SELECT bool_or(source = 'client') AS client, bool_or(source = 'router') AS router,
        bool_or(source = 'prefill') AS prefill, bool_or(source = 'decode') AS decode,
        arg_max(attr_bidir, (f, n)) FILTER (WHERE event = 'engine_start' AND source = 'prefill'
          AND attr_bidir IS NOT NULL) AS p_bidir,
        arg_max(attr_bidir, (f, n)) FILTER (WHERE event = 'engine_start' AND source = 'decode'
          AND attr_bidir IS NOT NULL) AS d_bidir,
        arg_max(coalesce(ttl_s, attr_ttl), (f, n)) FILTER (WHERE (event = 'kv_retained' AND ttl_s IS NOT NULL)
          OR (event = 'engine_start' AND source = 'decode' AND attr_ttl IS NOT NULL)) AS decode_ttl,
        arg_max(attr_block_size, (f, n)) FILTER (WHERE event = 'engine_start' AND attr_block_size IS NOT NULL)
          AS block_size
      FROM ev),
v AS (SELECT bool_or(kind = 'bidir_enabled' AND role = 'prefill') AS p_bidir,
        bool_or(kind = 'bidir_enabled' AND role = 'decode') AS d_bidir,
        bool_or(role = 'prefill' AND level = 'DEBUG') AS p_debug,
        arg_max(threshold, (f, n)) FILTER (WHERE kind = 'bidir_enabled' AND role = 'prefill') AS threshold,
        arg_max(ttl_s, (f, n)) FILTER (WHERE kind = 'bidir_enabled' AND role = 'decode' AND ttl_s IS NOT NULL)
          AS decode_ttl,
        arg_max(block_size, (f, n)) FILTER (WHERE kind = 'read_blocks') AS block_size
      FROM vl_r),
p AS (SELECT arg_max(TRY_CAST(ttl AS DOUBLE), seq) FILTER (WHERE kind = 'stale') AS router_ttl FROM pl)
SELECT
  coalesce(fl.stats_file, false) OR coalesce(e.client, false) AS ctx_has_client,
  coalesce(fl.proxy_file, false) OR coalesce(e.router, false) AS ctx_has_router,
  coalesce(fr.p_file, false) OR coalesce(e.prefill, false) AS ctx_has_prefill,
  coalesce(fr.d_file, false) OR coalesce(e.decode, false) AS ctx_has_decode,
  coalesce(e.p_bidir, CASE WHEN coalesce(fr.p_file, false) THEN coalesce(v.p_bidir, false) END) AS ctx_p_bidir,
  coalesce(e.d_bidir, CASE WHEN coalesce(fr.d_file, false) THEN coalesce(v.d_bidir, false) END) AS ctx_d_bidir,
  coalesce(v.p_debug, false) AS ctx_p_debug,
  v.threshold AS ctx_threshold,
  coalesce(e.decode_ttl, v.decode_ttl::DOUBLE) AS ctx_decode_ttl,
  coalesce(e.block_size, v.block_size, {DEFAULT_BLOCK_SIZE}) AS ctx_block_size,
  p.router_ttl AS ctx_router_ttl
FROM fl, fr, e, v, p"""

# What the previous turn of the conversation says, as the rules read it: prev_<name> is its <value> (of f).
_PREV: Final = (("sid", "f.sid"), ("turn", "f.turn"), ("stored", "f.px_stored"),
                ("has_stored", "coalesce(f.px_has_stored, false)"), ("not_stored", "f.px_not_stored"),
                ("has_not_stored", "coalesce(f.px_has_not_stored, false)"), ("not_stored_why", "f.px_not_stored_why"),
                ("aborted", "f.aborted"), ("failed_why", "f.failed_why"), ("failed_ref", "f.failed_ref"),
                ("px_first", "f.px_first"), ("has_px", "f.has_px"), ("px_po", "f.px_po"),
                ("stored_po", "f.px_stored_po"), ("s_input_num_tokens", "f.s_input_num_tokens"),
                ("s_output_num_tokens", "f.s_output_num_tokens"), ("stat_ref", "f.stat_ref"),
                ("s_start_time_ms", "f.s_start_time_ms"), ("s_latency_ms", "f.s_latency_ms"))
_ORDER_BY: Final = "PARTITION BY conversation_id ORDER BY turn, coalesce(px_po, 0), sid"

# Each turn with its conversation's previous turn and the facts the rules derive from several columns.
TURNS_SQL: Final = f"""CREATE TEMP VIEW tf AS
WITH base AS (SELECT t.*, ctx.*, t.px_seq IS NOT NULL AS has_px,
    coalesce(t.has_events, false) AS has_ev,
    CASE WHEN coalesce(t.has_events, false) THEN coalesce(t.client_ok, false)
         ELSE t.px_stored IS NOT NULL OR (t.has_stat AND NOT (t.px_seq IS NOT NULL
              AND t.px_stored IS NULL AND NOT coalesce(t.px_done, false))) END AS answered,
    t.px_stored IS NOT NULL AS px_has_stored, t.px_not_stored IS NOT NULL AS px_has_not_stored
  FROM turn_facts t, ctx),
f AS (SELECT *, CASE WHEN answered THEN NULL ELSE coalesce(ev_failed_why, vl_failed_why, px_failed_why) END
    AS failed_why,
    CASE WHEN answered THEN NULL WHEN ev_failed_why IS NOT NULL THEN ev_failed_ref
         WHEN vl_failed_why IS NOT NULL THEN vl_failed_ref ELSE px_failed_ref END AS failed_ref,
    CASE WHEN has_ev THEN client_ok_ref ELSE coalesce(stat_ref, px_stored) END AS answer_proof,
    epoch(TRY_CAST(left(px_first_ts, 10) AS DATE)) + TRY_CAST(substr(px_first_ts, 12, 2) AS INTEGER) * 3600
      + TRY_CAST(substr(px_first_ts, 15, 2) AS INTEGER) * 60 + TRY_CAST(substr(px_first_ts, 18, 2) AS INTEGER)
      AS px_start
  FROM base),
-- the conversation's order, the previous turn's key and whether every earlier request failed and stored no handle
-- (one narrow window pass), then the previous turn by a join on its key (cheaper than a lag() per column) and the
-- proxy's restart ('Ready' line) since, all on narrow rows: the turn's wide row is joined once, at the end
ord AS (SELECT sid, px_last_f, px_po, has_px, row_number() OVER ({_ORDER_BY}) AS pos,
    lag(sid) OVER ({_ORDER_BY}) AS prev_key,
    coalesce(bool_and((failed_why IS NOT NULL OR (has_px AND NOT coalesce(px_has_stored, false)
          AND NOT coalesce(px_done, false))) AND NOT coalesce(px_has_stored, false))
      OVER ({_ORDER_BY} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), false) AS earlier_all_failed
  FROM f),
turn_prev AS (SELECT o1.sid, o1.pos, {", ".join(f"{v} AS prev_{k}" for k, v in _PREV)}, o1.earlier_all_failed,
    o1.px_last_f AS own_last_f, o1.px_po AS own_px_po, o1.has_px AS own_has_px
  FROM ord o1 LEFT JOIN f ON f.sid = o1.prev_key),
restart AS (SELECT tp.sid, arg_min((r.f::BIGINT << 40) + r.n, r.po) AS restart_ref FROM turn_prev tp JOIN ready r
    ON r.f = tp.own_last_f AND r.po > coalesce(tp.prev_stored_po, tp.prev_px_po) AND r.po < tp.own_px_po
  WHERE tp.prev_has_px AND tp.own_has_px GROUP BY tp.sid),
o AS (SELECT f.*, turn_prev.* EXCLUDE (sid, own_last_f, own_px_po, own_has_px), restart.restart_ref
  FROM f JOIN turn_prev USING (sid) LEFT JOIN restart USING (sid))
SELECT o.* EXCLUDE (restart_ref),
  coalesce(c_ttft_ms, s_ttft_ms, e_ttft_ms) AS ttft_ms,
  coalesce(c_prompt_tokens, s_input_num_tokens, e_prompt_tokens) AS prompt_tokens,
  coalesce(c_completion_tokens, s_output_num_tokens, e_completion_tokens) AS completion_tokens,
  coalesce(c_latency_ms, s_latency_ms, e_latency_ms) AS latency_ms,
  coalesce(e_ts, CASE WHEN s_start_time_ms >= 1e12 THEN s_start_time_ms / 1000.0 END, px_start) AS start_ts,
  coalesce(e_prefill_ms, px_prefill_ms) AS prefill_ms,
  coalesce(e_entry_age_s, TRY_CAST(px_age AS DOUBLE)) AS entry_age_s,
  coalesce(c_status, bad_status, first_status) AS status, e_remote_tokens AS remote_tokens,
  e_local_hit_tokens AS local_hit_tokens, e_remote_offered_tokens AS remote_offered_tokens,
  e_computed_tokens AS computed_tokens, e_transfer_bytes AS transfer_bytes, e_transfer_ms AS transfer_ms,
  e_failure_type AS failure_type, e_model AS model, e_handle_tokens AS handle_tokens,
  e_reuse_limit_tokens AS reuse_limit_tokens, e_trimmed_tokens AS trimmed_tokens, e_trim_reason AS trim_reason,
  e_wrong_kv_tokens AS wrong_kv_tokens, e_mismatch_tokens AS mismatch_tokens, e_gap_s AS ev_gap_s,
  turn = 1 AND prev_sid IS NULL AND (has_px OR (has_stat AND coalesce(s_input_num_turns, 1) <= 2)) AS is_first,
  coalesce(prev_has_px AND has_px AND prev_stored_po IS NOT NULL AND prev_stored_po > px_po, false)
    AS is_concurrent, restart_ref,
  CASE WHEN prev_sid IS NOT NULL AND prev_s_start_time_ms IS NOT NULL AND prev_s_latency_ms IS NOT NULL
       AND s_start_time_ms IS NOT NULL
       AND (s_start_time_ms - prev_s_start_time_ms - prev_s_latency_ms) / 1000.0 >= 0
       THEN (s_start_time_ms - prev_s_start_time_ms - prev_s_latency_ms) / 1000.0 END AS client_gap
FROM o"""

WINDOW_COLUMNS: Final = ("w_found BOOLEAN, w_read BOOLEAN, w_why VARCHAR, w_refs BIGINT[], w_rejected BIGINT, "
                         "w_prefix_caching BOOLEAN, w_recovered BOOLEAN, w_caching_ref BIGINT")


def _finds_a_row(run: Run, query: str) -> bool:
    return bool(run.con.execute(f"SELECT EXISTS ({query})").fetchall()[0][0])


def _as_run(run: Run, q: str, *, no_events: bool) -> list[str]:
    """The statements that stand for ``q`` in this run: none or an empty table for an events-only one without
    events; with few rows, a union's branches that have rows, a turn view as a table, the few-rows-only ones and
    not the bulk-only ones."""
    if no_events and isinstance(q, EventsOnly):
        stood_in = stand_in(q)
        return [] if stood_in is None else [stood_in]
    if not run.few_rows:
        return [] if isinstance(q, FewRowsOnly) else [q]
    if isinstance(q, BulkOnly):
        return []
    if isinstance(q, EventsUnion):
        split = branch_statements(q, lambda probe: _finds_a_row(run, probe))
        if split is not None:
            return split
    return [_TURN_VIEW.sub(r"CREATE TEMP TABLE \1 AS", q, count=1)]


_TURN_VIEW: Final = re.compile(r"^CREATE TEMP VIEW (turn_facts|tf) AS\b")


def decide_statements(run: Run) -> list[str]:
    """The statements that correlate the records and collect the facts (after parse)."""
    kinds = [k for (k,) in run.con.execute("SELECT DISTINCT kind FROM vl WHERE kind IS NOT NULL").fetchall()]
    merged = run.merged_proxy_logs
    return [*join_sql(run.only, merged=merged), *facts_sql(kinds, run.event_columns), views_sql(merged), CONTEXT_SQL,
            TURNS_SQL]


def use_few_rows(run: Run) -> None:
    """Plan for a few dozen rows (one conversation's): DuckDB's optimizer costs more than it saves there (about a
    third of each statement's planning; the plans stay hash joins on tables this small), a second thread has
    nothing to share but still wakes for every statement, and the turn views are written as tables, which the
    rules (run twice when P's stats windows are read) then read without binding the views' joins each time.
    The statements share one transaction: a commit after each of some seventy statements costs about a tenth of
    their time; a run's tables live only as long as its connection anyway."""
    run.con.execute("PRAGMA disable_optimizer")
    run.con.execute("SET threads = 1")
    run.con.execute("BEGIN TRANSACTION")
    run.few_rows = True


def decide(run: Run) -> None:
    """Correlate, collect the facts and apply the rules: ``decided`` (one row per turn)."""
    no_events = not _finds_a_row(run, "SELECT 1 FROM ev_t")
    for q in decide_statements(run):
        for part in _as_run(run, q, no_events=no_events):
            execute(run, part)
    # (the rules' joins reuse the memory of the tables only the correlation read)
    for table in _JOINS_ONLY:
        run.con.execute(f"DROP TABLE IF EXISTS {table}")
    run.con.execute(f"CREATE TEMP TABLE wfind (rid VARCHAR, {WINDOW_COLUMNS})")
    _decide_with_windows(run)


# the tables the correlation builds for itself: nothing after it reads them
_JOINS_ONLY: Final = ("px_def", "px_order", "px_new", "slot_src", "placed", "cs_pick", "cs_new", "vl_slot", "offered",
                      "known_ids", "tag_map", "tev", "ev_slot_key", "lone", "lone_taken", "ev_rid_only", "eng_new")


def _decide_with_windows(run: Run) -> None:
    run.con.execute("""CREATE OR REPLACE TEMP VIEW tfw AS SELECT tf.*, coalesce(w.w_found, false) AS w_found,
        w.w_read, w.w_why, coalesce(w.w_refs, []) AS w_refs, w.w_rejected, w.w_prefix_caching,
        coalesce(w.w_recovered, false) AS w_recovered, w.w_caching_ref
      FROM tf LEFT JOIN wfind w ON w.rid = tf.px_rid""")
    keep = (*RECORD_COLUMNS, "sid", "px_rid")
    if not run.few_rows:
        run.con.execute("CREATE OR REPLACE TEMP TABLE decided AS " + decide_sql("tfw", keep, evidence=run.evidence))
        return
    # a few turns reach a few rules: only theirs are bound
    run.con.execute(f"CREATE OR REPLACE TEMP TABLE tfw_picked AS SELECT *, {pick_sql()} AS rule_no FROM tfw")
    picked = {r for (r,) in run.con.execute("SELECT DISTINCT rule_no FROM tfw_picked").fetchall()}
    run.con.execute("CREATE OR REPLACE TEMP TABLE decided AS "
                    + decide_sql("tfw_picked", keep, evidence=run.evidence, picked=picked))


def wanted_windows(run: Run) -> list[str]:
    """Request ids of the turns only P's stats windows can decide."""
    return [r for (r,) in run.con.execute("SELECT px_rid FROM decided WHERE wants_windows AND px_rid IS NOT NULL "
                                          "ORDER BY px_rid").fetchall()]


def apply_windows(run: Run, findings: Sequence[tuple[object, ...]]) -> None:
    """Decide again with P's stats-window findings (rows of WINDOW_COLUMNS after the request id)."""
    run.con.execute("DELETE FROM wfind")
    insert_rows(run.con, "wfind", ("VARCHAR", *_WINDOW_TYPES), findings)
    _decide_with_windows(run)


_WINDOW_TYPES: Final = tuple(c.split()[1] for c in WINDOW_COLUMNS.split(", "))


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, types: Sequence[str], rows: Sequence[Sequence[object]]
                ) -> None:
    """Append ``rows`` (values of the SQL ``types``, in the table's column order) to ``table`` in one statement:
    one list per column, unnested side by side (executemany runs a statement per row: seconds for 20k rows)."""
    if not rows:
        return
    columns = [list(col) for col in zip(*rows, strict=True)]
    select = ", ".join(f"unnest(${i}::{t}[])" for i, t in enumerate(types, start=1))
    con.execute(f"INSERT INTO {table} SELECT {select}", columns)


@contextlib.contextmanager
def opened(files: list[LogFile], only: str | None = None) -> Iterator[Run]:
    """A run over ``files``, closed afterwards."""
    run = new_run(files, only)
    try:
        yield run
    finally:
        run.con.close()


RECORD_COLUMNS: Final = (
    "conversation_id", "turn", "request_id", "start_ts", "ttft_ms", "latency_ms", "prompt_tokens",
    "completion_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_tokens", "computed_tokens",
    "transfer_bytes", "transfer_ms", "prefill_ms", "ev_gap_s", "client_gap", "prev_sid", "entry_age_s", "status",
    "failure_type", "prefill_request_id", "decode_request_id", "model", "handle_tokens", "reuse_limit_tokens",
    "trimmed_tokens", "trim_reason", "wrong_kv_tokens", "mismatch_tokens", "verdict", "confidence", "reason",
    "evidence", "pos")


def decided_rows(run: Run) -> pa.Table:
    """The decided turns, in conversation order (the columns TurnRecord and the turn table read), without their
    evidence (:func:`decided_evidence`)."""
    duckdb_api.with_python_layer()
    return run.con.sql(f"SELECT {_RECORD_SELECT} FROM decided {_ORDER}").to_arrow_table()


def decided_evidence(run: Run, turns: int) -> tuple[pa.Table, list[int], list[int]]:
    """Every decided turn's evidence: the texts (source, text) of the lines cited, one row per line however many
    turns cite it, and the citations as indexes into them, turn after turn in conversation order: the ``k``-th
    turn's (of ``turns``) are ``at[offsets[k]:offsets[k + 1]]``. (The caller makes each line's object once; a
    list of structs per turn would copy each text once more for every turn citing it.)"""
    import numpy as np  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    # each ref's text looked up by Arrow in the texts (one row per ref): sorting the texts into the turns' order
    # in DuckDB costs several times more
    duckdb_api.with_python_layer()
    texts = run.con.sql(_evidence_texts(run)).to_arrow_table()
    refs = run.con.sql("SELECT i, ref FROM ev_refs ORDER BY i, k").to_arrow_table()
    at = pc.index_in(refs.column("ref"), value_set=texts.column("ref")).combine_chunks()
    found = at.is_valid()
    counts = np.bincount(refs.column("i").combine_chunks().filter(found).to_numpy(), minlength=turns)
    offsets = np.zeros(turns + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return texts, at.filter(found).to_numpy().tolist(), offsets.tolist()


def decided_lists(run: Run) -> tuple[dict[str, list[Any]], list[list[tuple[str, str]]]]:
    """:func:`decided_rows` as Python lists: each column's values, and each turn's evidence as (source, text)
    pairs. For a few turns (one conversation): pyarrow's first use would cost more than the rows (it
    imports pandas)."""
    cols = [c for c in RECORD_COLUMNS if c != "evidence"]
    rows = run.con.execute(f"SELECT {_RECORD_SELECT} FROM decided {_ORDER}").fetchall()
    columns = {c: [r[k] for r in rows] for k, c in enumerate(cols)}
    evidence: list[list[tuple[str, str]]] = [[] for _ in rows]
    texts = _evidence_texts(run)
    for i, source, text in run.con.execute(f"SELECT r.i, t.source, t.text FROM ev_refs r JOIN ({texts}) t USING (ref) "
                                           "ORDER BY r.i, r.k").fetchall():
        evidence[i].append((source, text))
    return columns, evidence


_ORDER: Final = "ORDER BY conversation_id, pos"  # (conversation, place in it) is unique: one order for every query
_RECORD_SELECT: Final = ", ".join(c for c in RECORD_COLUMNS if c != "evidence")


def _evidence_texts(run: Run) -> str:
    """Every turn's evidence refs into ``ev_refs`` (turn index in conversation order, ref, place in the turn's
    evidence), each line once per turn (a rule and the turn's failure may cite the same line); returns the query
    of their texts (ref, source, text), one row per ref."""
    run.con.execute(f"""CREATE OR REPLACE TEMP TABLE ev_refs AS SELECT i, ref, min(k) AS k FROM (
        SELECT i, unnest(evidence) AS ref, generate_subscripts(evidence, 1) AS k FROM (
          SELECT row_number() OVER ({_ORDER}) - 1 AS i, evidence FROM decided)) GROUP BY i, ref""")
    return evidence_texts_sql(run.con, "ev_refs")
