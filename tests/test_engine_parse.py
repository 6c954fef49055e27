"""The engine's SQL parsers give the Python parsers' kinds, fields and evidence text, line for line.

Every fixture log (real vLLM 0.33 lines, the INFO run, the stock run) and generated data sets: a record
the Python parser finds is in the engine's table with the same kind, request ids and text.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from re import _constants, _parser
from typing import Any

import duckdb
import pytest
from engine_lines_support import insert_lines
from gen_logs_support import load_gen_logs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics import engine_proxy
from kvdiag.diagnostics import verdict_engine as engine
from kvdiag.diagnostics.detect import LogFile
from kvdiag.diagnostics.engine_json_records import read_odd_json
from kvdiag.diagnostics.engine_proxy import longest_literal
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_numbered
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log_parser import CLASSIFIERS as PROXY_CLASSIFIERS
from kvdiag.diagnostics.proxy_log_parser import parse_proxy_numbered
from kvdiag.diagnostics.vllm_log_parser import parse_vllm_numbered

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "logs"
# kinds only P's stats windows read (windows.py parses those lines itself)
WINDOW_KINDS = frozenset({"transfer_plan", "engine_config", "engine_stats", "kv_metrics"})


def _gen_logs(out: Path) -> Path:
    load_gen_logs().generate(out, 200_000, seed=4, noise_per_turn=1)
    return out


def _load(con: duckdb.DuckDBPyConnection, table: str, f: int, path: Path) -> list[tuple[int, bytes]]:
    numbered = list(enumerate(path.read_bytes().split(b"\n"), start=1))
    if numbered and numbered[-1][1] == b"":
        numbered.pop()
    insert_lines(con, table, numbered, str(path), f=f)
    return numbered


def _engine(files: list[Path], *, ascii_branch: bool = True, words: bool = False, stats: bool = True
            ) -> tuple[duckdb.DuckDBPyConnection, dict[int, list[tuple[int, bytes]]]]:
    """The engine's parse of ``files``; ``ascii_branch``/``words`` as the engine picks them for many lines
    (the default) or for few (False / the first words present and the proxy classifiers the lines hold a literal
    of); ``stats`` as for runs with (the default) or without a client statistics file."""
    con = duckdb.connect()
    ep.create_line_tables(con)
    loaded = {}
    for f, path in enumerate(files):
        table = ("lines_proxy" if "proxy" in path.name else "lines_json" if path.suffix in (".json", ".jsonl")
                 else "lines_vllm")
        loaded[f] = _load(con, table, f, path)
    for q in ep.parse_json_sql(stats=stats):
        con.execute(q)
    proxy = [ln for (ln,) in con.execute("SELECT line FROM lines_proxy WHERE line IS NOT NULL").fetchall()]
    proxy_sql = ep.parse_proxy_sql(proxy) if words else ep.parse_proxy_sql(
        all_ascii=all(t.isascii() for t in proxy), cr=any(t.endswith("\r") for t in proxy))
    for q in (*ep.parse_events_sql(ep.event_fields(con), stats=stats), *proxy_sql,
              *ep.vllm_head_sql(ascii_branch=ascii_branch)):
        con.execute(q)
    present = [w for (w,) in con.execute(f"SELECT DISTINCT {ep.VLLM_WORD} FROM vl_head").fetchall()]
    con.execute(ep.vllm_records_sql(present if words else None, ascii_branch=ascii_branch))
    read_odd_json(con, {f: str(p) for f, p in enumerate(files)}, LineStats())
    return con, loaded


def _inputs(tmp_path: Path) -> list[Path]:
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.suffix in (".log", ".json", ".jsonl")
                   and "console" not in p.name and p.name != "vllm_real_lines.log")
    files.append(FIXTURES / "vllm_real_lines.log")
    return files + sorted(p for p in _gen_logs(tmp_path / "gen").iterdir())


def test_vllm_and_proxy_records_equal_the_python_parsers(tmp_path: Path) -> None:
    files = _inputs(tmp_path)
    con, loaded = _engine(files)
    vl = {(f, n): (kind, rid, list(rids or []), text) for f, n, kind, rid, rids, text in con.execute(
        f"SELECT v.f, v.n, v.kind, v.request_id, v.request_ids, {ep.VLLM_TEXT} FROM vl v JOIN vl_head h USING (f, n)"
    ).fetchall()}
    pl = {(row[0], row[1]): row[2:] for row in con.execute(
        "SELECT f, n, kind, rid, conv, remote, age, ttl, why, ms, detail, p FROM pl").fetchall()}
    seen = {"vllm": 0, "proxy": 0}
    for f, path in enumerate(files):
        if "proxy" in path.name:
            for prec in parse_proxy_numbered(loaded[f], str(path)):
                fl = prec.fields
                want = (prec.kind, fl.get("rid"), fl.get("conv"), fl.get("remote"), fl.get("age"), fl.get("ttl"),
                        fl.get("why") or None, fl.get("ms"), fl.get("detail"), fl.get("p"))
                assert pl.get((f, prec.lineno)) == want, (path, prec.lineno)
                seen["proxy"] += 1
        elif path.suffix == ".log":
            for rec in parse_vllm_numbered(loaded[f], str(path)):
                if "\n" in rec.msg:  # the engine reads a record's first line alone (a traceback follows)
                    continue
                kind = None if rec.kind in WINDOW_KINDS else rec.kind
                got = vl.get((f, rec.lineno))
                assert got is not None and got[0] == kind and got[3] == rec.text, (path, rec.lineno, got)
                if kind is not None:
                    assert got[1] == rec.fields.get("request_id"), (path, rec.lineno)
                    assert got[2] == list(rec.fields.get("request_ids", [])), (path, rec.lineno)
                seen["vllm"] += 1
    assert seen["vllm"] > 300 and seen["proxy"] > 200


@pytest.mark.parametrize("stats", [True, False])
def test_json_records_equal_json_logs(tmp_path: Path, stats: bool) -> None:
    files = [p for p in _inputs(tmp_path) if p.suffix in (".json", ".jsonl") and p.suffix != ".json"]
    bad = tmp_path / "odd.jsonl"
    good = {"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "conversation_id": "c", "turn": 2,
            "request_id": "r", "outcome": "remote_hit"}
    bad.write_text("\n".join([json.dumps(good), '{"v": 1, "ts": trunc', json.dumps({**good, "turn": 0}),
                              json.dumps({**good, "extra": 1}), json.dumps([{"conversation_id": "a", "ttft_ms": 1}]),
                              json.dumps({"conversation_id": 7, "ttft_ms": True}), "", "  "]) + "\n")
    files.append(bad)
    con, loaded = _engine(files, stats=stats)
    # (the evidence text of a JSON record is its stripped line, looked up when explain prints it)
    ev = {(f, n): (src, conv, turn, rid, outcome) for f, n, src, conv, turn, rid, outcome in con.execute(
        "SELECT f, n, source, conversation_id, turn, request_id, outcome FROM ev").fetchall()}
    cs = {(row[0], row[1]): row[2:] for row in con.execute(
        "SELECT f, n, conversation_id, ttft_ms, input_num_turns, turn, request_id FROM cs WHERE sub = 0").fetchall()}
    for f, path in enumerate(files):
        want_ev, want_cs = {}, {}
        for rec in parse_json_numbered(loaded[f], str(path)):
            if isinstance(rec, EventRecord):
                e = rec.event
                want_ev[(f, rec.lineno)] = (e.source, e.conversation_id, e.turn, e.request_id, e.outcome)
            elif isinstance(rec, ClientStat):
                want_cs.setdefault((f, rec.lineno), (rec.conversation_id, rec.ttft_ms, rec.input_num_turns,
                                                     rec.turn, rec.request_id))
        assert {k: v for k, v in ev.items() if k[0] == f} == want_ev, path
        assert {k: v for k, v in cs.items() if k[0] == f} == want_cs, path


# (with characters Python's \s, \d and \w read otherwise than RE2's: \v, \x1f, NBSP, an em space, an
# Arabic-Indic digit)
_ID = st.text(st.sampled_from("ab9_-.:()=x/é\v\x1f\xa0\u2003\u0663"), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([
    "Declining expired remote read for {r} from engine e-1.", "Skipping remote pull for {r}: 40 remote tokens < "
    "threshold 64", "Failing 1 request(s) due to KV load failure (failure_policy=fail, 12 tokens affected). "
    "Request IDs: {{'{r}'}}", "Aborted request(s) {r}, {r}x.", "Request {r} aborted.", "Request {r} failed (boom).",
    "Request {r} failed with an internal error during generation", "Generated response {r}: output: 'x', "
    "finish_reason: error", "NIXL transfer failure: handshake_failed | Context: {{'request_id': '{r}', "
    "'remote_request_id': 'x'}}", "{r} is still in WAITING_FOR_REMOTE_KVS state.", "start_load_kv for request {r} "
    "from remote engine e. Num local_block_ids: 0. Num remote_block_ids: 3", "Received request {r}: params"]),
    _ID, st.booleans()), min_size=1, max_size=10))
def test_vllm_messages_match_the_parser(tmp_path: Path, rows: list[tuple[str, str, bool]]) -> None:
    coloured = "\x1b[32mINFO\x1b[0m"
    lines = [(f"(EngineCore_DP0 pid=1) {coloured if colour else 'ERROR'} 11-29 06:54:50 "
              f"[base.py:1] " + t.format(r=r)) for t, r, colour in rows]
    path = tmp_path / "prefill.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for ascii_branch, words in ((True, False), (False, True)):  # many lines' statements, and few lines'
        con, loaded = _engine([path], ascii_branch=ascii_branch, words=words)
        got = {n: (kind, rid, list(rids or [])) for n, kind, rid, rids in
               con.execute("SELECT n, kind, request_id, request_ids FROM vl").fetchall()}
        for rec in parse_vllm_numbered(loaded[0], str(path)):
            want = (rec.kind, rec.fields.get("request_id"), list(rec.fields.get("request_ids", [])))
            assert got[rec.lineno] == want, (ascii_branch, rec.msg, got[rec.lineno])


# (the characters of _ID, and a carriage return)
_PROXY_TEXT = st.text(st.sampled_from("ab9_-.:()=x/é [s\v\x1f\xa0\u2003\u0663\r"), min_size=0, max_size=10)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([
    "[{r}] conv={c}: cache MISS", "[{r}] conv={c}: cache MISS ({w})", "[{r}] conv={c}: cache MISS ({w}",
    "[{r}] conv={c}: cache MISS{w}", "conv={c}: cache HIT (age=1.5s)", "conv={c}: stale cache entry (age=9.0s > "
    "ttl=4.5s), discarding", "conv={c}: cached D blocks (remote_request_id={w}, blocks=3)", "[{r}] conv={c}: sending "
    "D's cached blocks to P (remote_request_id={w})", "[{r}] Prefill done in 12ms", "[{r}] conv={c}: no D-to-P handle "
    "offered", "[{r}] No conversation_id provided", "[{r}] Prefill request failed: {w}", "conv={c}: cache MISS ({w})",
    "[{r}] conv={c}: not caching D blocks{w}", "Ready: 1 prefill, 2 decode instances"]),
    _PROXY_TEXT, _PROXY_TEXT, _PROXY_TEXT), min_size=1, max_size=10))
def test_proxy_messages_match_the_parser(tmp_path: Path, rows: list[tuple[str, str, str, str]]) -> None:
    """Every kind and group the engine cuts by position equals the proxy parser's (ids with odd characters)."""
    lines = [f"2025-11-29 06:55:00 [INFO] disagg_proxy: {t.format(r=r, c=c, w=w)}" for t, r, c, w in rows]
    # every classifier, and (one conversation's lines) only those the lines can meet, in their ASCII forms
    # where every line is ASCII (the second file)
    ascii_lines = [ln.encode("ascii", "replace").decode() for ln in lines]
    for name, text, few in (("proxy.log", lines, False), ("proxy.log", lines, True),
                            ("ascii-proxy.log", ascii_lines, True), ("ascii-proxy.log", ascii_lines, False)):
        path = tmp_path / name
        path.write_text("\n".join(text) + "\n", encoding="utf-8")
        con, loaded = _engine([path], words=few)
        # (a why of '' is no why: the rules read both alike)
        got = {row[0]: row[1:] for row in con.execute(
            "SELECT n, kind, rid, conv, remote, age, ttl, nullif(why, ''), ms, detail, blocks FROM pl").fetchall()}
        want = {}
        for prec in parse_proxy_numbered(loaded[0], str(path)):
            fl = prec.fields
            want[prec.lineno] = (prec.kind, fl.get("rid"), fl.get("conv"), fl.get("remote"), fl.get("age"),
                                 fl.get("ttl"), fl.get("why") or None, fl.get("ms"), fl.get("detail"), fl.get("blocks"))
        assert got == want, few


def test_the_proxy_patterns_ascii_forms_are_only_for_ascii_lines(tmp_path: Path) -> None:
    """Negative control for the gate: on a line with a Unicode space in the conversation id, the ASCII forms take
    a line the parser does not (Python's \\S stops at U+2003; the ASCII form's class does not)."""
    line = "2025-11-29 06:55:00 [INFO] disagg_proxy: conv=a\u2003b: cache HIT (age=1.5s)"
    path = tmp_path / "proxy.log"
    path.write_text(line + "\n", encoding="utf-8")
    assert [p.kind for p in parse_proxy_numbered([(1, line.encode())], str(path))] == []
    kinds = {}
    for all_ascii in (False, True):
        con = duckdb.connect()
        ep.create_line_tables(con)
        con.execute("INSERT INTO lines_proxy VALUES (0, 1, $l)", {"l": line})
        for q in engine_proxy.parse_proxy_sql(engine_proxy.kinds_present([line]), all_ascii=all_ascii):
            con.execute(q)
        kinds[all_ascii] = [k for (k,) in con.execute("SELECT kind FROM pl").fetchall()]
    assert kinds == {False: [], True: ["hit"]}
    assert "\\p{" not in ep.parse_proxy_sql([line.encode("ascii", "replace").decode()])[0]  # (the gate opens)
    assert "\\p{" in ep.parse_proxy_sql([line])[0]


_PARSE_PROXY_SQL = ep.parse_proxy_sql  # (the engine's own, whatever a test patches in its place)


def _bulk_pl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, columns: str,
             chosen: list[dict[str, Any]], **force: Any) -> list[tuple[Any, ...]]:
    """``pl``'s ``columns`` (in line order) for a proxy log holding ``text``, parsed by the engine's whole-file path.
    The options the engine picks for parse_proxy_sql go into ``chosen``; ``force`` overrides them."""
    path = tmp_path / "proxy.log"
    path.write_bytes(text.encode())

    def spy(lines: Any = None, **options: Any) -> list[str]:
        chosen.append(options)
        return _PARSE_PROXY_SQL(lines, **{**options, **force})

    monkeypatch.setattr(ep, "parse_proxy_sql", spy)
    run = engine.new_run([LogFile(str(path), "proxy", size=path.stat().st_size)])
    try:
        engine.load_files(run)
        engine.parse(run)
        return run.con.execute(f"SELECT {columns} FROM pl ORDER BY n").fetchall()
    finally:
        run.con.close()


def test_the_bulk_proxy_parse_takes_the_ascii_forms_only_when_every_line_is_ascii(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's whole-file path: an all-ASCII proxy log is parsed with the ASCII forms, and a log with one
    line the ASCII forms would misread (a Unicode space in the conversation id) with the Unicode-aware ones, so
    that line is no record (negative control: forced to the ASCII forms, it becomes a cache hit)."""
    head = "2025-11-29 06:55:00 [INFO] disagg_proxy: "
    plain = [f"{head}[r{i}] conv=c{i}: cache MISS" for i in range(3)]
    odd = f"{head}conv=a\u2003b: cache HIT (age=1.5s)"
    chosen: list[dict[str, Any]] = []

    def kinds(lines: list[str], **force: Any) -> list[str]:
        rows = _bulk_pl(tmp_path, monkeypatch, "\n".join(lines) + "\n", "kind", chosen, **force)
        return [k for (k,) in rows]

    assert kinds(plain) == ["miss"] * 3
    assert kinds([*plain, odd]) == ["miss"] * 3
    assert [c["all_ascii"] for c in chosen] == [True, False]
    assert kinds([*plain, odd], all_ascii=True) == ["miss"] * 3 + ["hit"]  # (the control: the gate matters)


def test_the_bulk_proxy_parse_trims_a_carriage_return_only_where_a_line_has_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CRLF proxy log (read by Python, each line keeping its CR) gives the parser's fields, the message's last
    group without the CR; a log without one is read untrimmed (negative control: the CRLF log untrimmed puts the
    CR into the failure's detail and the reason)."""
    head = "2025-11-29 06:55:00 [INFO] disagg_proxy: "
    lines = [f"{head}[r1] Prefill request failed: boom", f"{head}[r2] conv=c2: not caching D blocks (no params)"]
    chosen: list[dict[str, Any]] = []

    def fields(text: str, **force: Any) -> list[tuple[Any, ...]]:
        return _bulk_pl(tmp_path, monkeypatch, text, "n, kind, rid, detail, why", chosen, **force)

    want = [(p.lineno, p.kind, p.fields.get("rid"), p.fields.get("detail"), p.fields.get("why"))
            for p in parse_proxy_numbered([(i + 1, ln.encode()) for i, ln in enumerate(lines)], "proxy.log")]
    assert [w[3] for w in want] == ["boom", None] and want[1][4] == " (no params)"
    assert fields("".join(ln + "\r\n" for ln in lines)) == want
    assert fields("".join(ln + "\n" for ln in lines)) == want
    assert [c["cr"] for c in chosen] == [True, False]
    got = fields("".join(ln + "\r\n" for ln in lines), cr=False)
    assert [g[3] for g in got] == ["boom\r", None] and got[1][4] == " (no params)\r"


def _required_runs(seq: Any) -> list[str]:
    """The literal runs every match of a parsed pattern holds (a run ends at anything that may match otherwise)."""
    if seq.state.flags & re.IGNORECASE:
        return []
    runs, cur = [], ""
    for op, av in seq:
        if op is _constants.LITERAL:
            cur += chr(av)
            continue
        runs.append(cur)
        cur = ""
        if op is _constants.SUBPATTERN and not av[1] & re.IGNORECASE:  # (a group that must match: its runs too)
            runs.extend(_required_runs(av[3]))
        elif op in (_constants.MAX_REPEAT, _constants.MIN_REPEAT) and av[0] >= 1:
            runs.extend(_required_runs(av[2]))
    return [r for r in [*runs, cur] if r]


def test_each_proxy_classifier_s_literal_is_in_every_line_it_takes() -> None:
    # The proxy statement tests a kind's literal before its pattern, and a conversation's run leaves out the
    # classifiers whose literal none of its lines holds: the literal must be one no match can lack.
    for kind, regex in PROXY_CLASSIFIERS:
        literal = longest_literal(regex)
        assert any(literal in run for run in _required_runs(_parser.parse(regex.pattern, regex.flags))), kind
    # negative controls: an optional or alternative literal is not required
    for pattern, literal in ((r"abcd?e", "abcd"), (r"x(?:hello|hi)", "hello"), (r"k(?:longer)*", "longer")):
        assert not any(literal in run for run in _required_runs(_parser.parse(pattern)))
    assert "hello" in _required_runs(_parser.parse(r"x(?:hello)+y"))


# (the text "\\x01", four characters, was once the reader's delimiter: a line holding it was cut there)
@pytest.mark.parametrize("line", ["plain", "caf\xe9 \u2603", "b'\\x01\\x02' and what follows"])
def test_lines_are_numbered_as_grep_numbers_them(tmp_path: Path, line: str) -> None:
    path = tmp_path / "x.log"
    path.write_text(f"{line}\n\n{line}\n   \n{line}", encoding="utf-8")
    con = duckdb.connect()
    ep.create_line_tables(con)
    con.execute(ep.read_lines_sql("lines_vllm", 0, str(path)))
    rows = con.execute("SELECT n, line FROM lines_vllm ORDER BY n").fetchall()
    assert [(n, text) for n, text in rows if text and text.strip()] == [(1, line), (3, line), (5, line)]


def test_non_ascii_lines_take_the_unicode_patterns(tmp_path: Path) -> None:
    """ASCII lines are matched with the patterns as written (faster); a line with other characters must take
    the Unicode-aware form, or an id with a letter like "é" would lose its kind and its request id."""
    ids = ["chatcmpl-é1", "chatcmpl-a1", "ß-req"]
    path = tmp_path / "prefill.log"
    path.write_text("".join(f"(APIServer pid=1) INFO 11-29 06:54:50 [logger.py:45] Received request {r}: params\n"
                            f"(wörker pid=2) INFO 11-29 06:54:51 [nixl.py:9] Skipping remote pull for {r}: 40 remote "
                            "tokens < threshold 64\n" for r in ids), encoding="utf-8")
    con, _loaded = _engine([path])
    got = con.execute("SELECT kind, request_id FROM vl ORDER BY n").fetchall()
    assert got == [(k, r) for r in ids for k in ("received_request", "skip_remote_pull")]
    # the control: RE2 reads the pattern as written in ASCII, so on these lines only the Unicode form matches
    received = next(p.compiled for k, p, _c in ep.vllm_log._CLASSIFIERS if k == "received_request")
    as_written = con.execute("SELECT regexp_matches($t, $p), regexp_matches($t, $u)",
                             {"t": "Received request chatcmpl-é1: params", "p": received.pattern,
                              "u": ep._re2(received)}).fetchall()[0]
    assert as_written == (False, True)


@pytest.mark.parametrize("stats", [True, False])
def test_events_carry_every_field_json_logs_reads(tmp_path: Path, stats: bool) -> None:
    # ev_t holds only the fields some line the SQL reads has: a field that only a line json_logs reads sets (an
    # array of events on one line) is added for its rows, and ev shows every field either way
    good = {"v": 1, "ts": 1.0, "source": "decode", "event": "decode_request", "conversation_id": "c", "turn": 1,
            "request_id": "r", "engine_request_id": "x-1"}
    later = {**good, "ts": 2.0, "decode_ms": 5.5, "attrs": {"block_size": 16, "bidirectional_kv_xfer": True}}
    path = tmp_path / "decode-events.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps([good, later]) + "\n" + json.dumps({**good, "turn": 2})
                    + "\n")
    files = [p for p in _inputs(tmp_path) if p.suffix == ".jsonl"] + [path]
    con, loaded = _engine(files, stats=stats)
    assert [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'ev' "
                                      "ORDER BY column_index").fetchall()] == list(ep.EV_ROW_COLUMNS)
    cols = [c for c in ep.EV_ROW_COLUMNS if c not in ("f", "n", "sub", "text", "cconv")]
    got = sorted(con.execute(f"SELECT f, n, {', '.join(cols)} FROM ev").fetchall(), key=repr)
    want = []
    for f, p in enumerate(files):
        for rec in parse_json_numbered(loaded[f], str(p)):
            if isinstance(rec, EventRecord):
                e, a = rec.event, rec.event.attrs
                want.append((f, rec.lineno, *(getattr(e, c) for c in cols[:-3]),
                             a.get("bidirectional_kv_xfer"), a.get("block_size"), a.get("decoder_kv_blocks_ttl")))
    assert got == sorted(want, key=repr)
    decode_ms, block = 2 + cols.index("decode_ms"), 2 + cols.index("attr_block_size")
    assert any(r[:2] == (len(files) - 1, 2) and r[decode_ms] == 5.5 and r[block] == 16 for r in got)
    assert len(got) > 100
    # the two events of the array line are told apart by sub; every other event's is 0
    assert con.execute("SELECT f, n, list(sub ORDER BY sub) FROM ev GROUP BY f, n HAVING count(*) > 1").fetchall() \
        == [(len(files) - 1, 2, [0, 1])]
    assert con.execute("SELECT count(*) FROM ev WHERE sub <> 0").fetchall() == [(1,)]


def test_class_escapes_read_by_re2_as_python_reads_them() -> None:
    """Each of Python's class escapes, translated, matches in RE2 (DuckDB) exactly the characters it matches in
    Python: every ASCII character and every non-ASCII one Python's \\s, \\d or \\w treat specially nearby."""
    chars = [chr(c) for c in range(128)] + [chr(c) for c in range(128, 0x3100) if chr(c).isspace()
                                            or unicodedata.category(chr(c)) in ("Nd", "Lo", "No", "Mn")][::7]
    chars += ["\u00e9", "\u0663", "\u00a0", "\u2003", "\u3000", "\u00b2", "_"]
    con = duckdb.connect()
    for escape in ("\\s", "\\S", "\\d", "\\D", "\\w", "\\W", "[\\s,]", "[\\d.]", "[\\w.:-]"):
        regex = re.compile(escape)
        want = [bool(regex.fullmatch(ch)) for ch in chars]
        uni = con.execute("SELECT list_transform($c, lambda ch: regexp_full_match(ch, $p))",
                          {"c": chars, "p": ep._re2(regex)}).fetchall()[0][0]
        assert uni == want, escape
        ascii_chars = [ch for ch in chars if ch.isascii()]
        got_ascii = con.execute("SELECT list_transform($c, lambda ch: regexp_full_match(ch, $p))",
                                {"c": ascii_chars, "p": ep.ascii_form(regex)}).fetchall()[0][0]
        assert got_ascii == [bool(regex.fullmatch(ch)) for ch in ascii_chars], escape
        if escape in ("\\s", "\\S"):  # (the control: RE2 reads them as written otherwise, even on ASCII)
            as_written = con.execute("SELECT list_transform($c, lambda ch: regexp_full_match(ch, $p))",
                                     {"c": ascii_chars, "p": escape}).fetchall()[0][0]
            assert as_written != [bool(regex.fullmatch(ch)) for ch in ascii_chars]
    with pytest.raises(ValueError, match="RE2 cannot read"):
        ep._re2(re.compile(r"\bx"))



_STAT = {"ttft_ms": 5.0, "latency_ms": 9.0, "start_time_ms": 1.0, "input_num_turns": 1, "input_num_tokens": 3,
         "output_num_tokens": 2}  # a statistic's numbers, its id added by each test


def _stats_both_ways(path: Path, columns: tuple[str, ...], *, stats: bool
                     ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The statistics of a JSON lines file as (line number, *columns): the engine's and json_logs'."""
    con, loaded = _engine([path], stats=stats)
    got = con.execute(f"SELECT n, {', '.join(columns)} FROM cs WHERE sub = 0 ORDER BY n").fetchall()
    want = [(r.lineno, *(getattr(r, c) for c in columns)) for r in parse_json_numbered(loaded[0], str(path))
            if isinstance(r, ClientStat)]
    return got, want


# A conversation id with characters JSON escapes (a quote, a backslash, a control character; "é" too where the
# writer escapes non-ASCII, as json.dumps does by default): such a line holds a backslash, the mark of a line
# whose keys are listed before it is typed. A statistics line with one was once dropped without a count (an
# unparenthesized "NOT a OR NOT x AND y AND z"), and one holding the text "\x01" was cut there by the reader.
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.text(st.sampled_from('ab"\\x01é\x01\t/'), min_size=1, max_size=8), st.booleans()),
                min_size=1, max_size=6), st.booleans())
def test_statistics_with_escaped_characters_equal_json_logs(tmp_path: Path, ids: list[tuple[str, bool]],
                                                            stats: bool) -> None:
    path = tmp_path / "client-stats.jsonl"
    path.write_text("".join(json.dumps({**_STAT, "conversation_id": conv}, ensure_ascii=escaped) + "\n"
                            for conv, escaped in ids), encoding="utf-8")
    got, want = _stats_both_ways(path, ("conversation_id",), stats=stats)
    assert got == want == [(n, conv) for n, (conv, _e) in enumerate(ids, start=1)]


def test_a_statistic_whose_id_json_escapes_is_read_by_the_bulk_load(tmp_path: Path) -> None:
    # the whole bulk path: DuckDB's line reader, then the parse (with the control: the reader's old delimiter,
    # the text "\x01", cuts such a line)
    path = tmp_path / "client-stats.jsonl"
    ids = ["conv\\x01tail", "caf\u00e9", 'say "hi"']
    path.write_text("".join(json.dumps({**_STAT, "conversation_id": c}) + "\n" for c in ids), encoding="utf-8")
    run = engine.new_run([LogFile(str(path), "client_stats", "client")])
    try:
        engine.load_files(run)
        engine.parse(run)
        assert run.con.execute("SELECT conversation_id FROM cs ORDER BY n").fetchall() == [(c,) for c in ids]
        assert run.stats.corrupt == 0
        old = ep.CSV_LINES.replace("delim = chr(1)", "delim = '\\x01'")
        assert old != ep.CSV_LINES
        cut = run.con.execute(f"SELECT line FROM read_csv({ep.sql_str(str(path))}, {old})").fetchall()
        assert not cut[0][0].endswith("}")
    finally:
        run.con.close()



# JSON values of every type where a statistic has a number or an id, and the literals json.loads reads beyond the
# standard (NaN, Infinity, 1e400 as infinity) or past a 64-bit word or a double: the engine once failed the whole
# run on an integer past 2**63 (a CAST), json_logs on Infinity (int() of it) and on an integer literal past a
# double's range (float() of it), and json_logs took true for an id ("True")
_STAT_LITERALS = ("0", "-3", "7.5", "1e3", "1E2", "-0.0", "true", "false", "null", '"12"', '""', "[1]", '{"a": 1}',
                  "9223372036854775807", "9223372036854775808", "-9223372036854775809", "18446744073709551615",
                  "18446744073709551616", "1.0e19", "NaN", "Infinity", "-Infinity", "1e400",
                  "123456789012345678901234567890", "1" + "0" * 400, "-1" + "0" * 400)
_STAT_VALUES = st.sampled_from(_STAT_LITERALS)
_STAT_FIELDS = ("conversation_id", "ttft_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
                "output_num_tokens", "turn", "request_id")


def _same(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [tuple("NaN" if isinstance(x, float) and x != x else x for x in r) for r in rows]  # (NaN != NaN)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.dictionaries(st.sampled_from(_STAT_FIELDS), _STAT_VALUES, max_size=4), min_size=1, max_size=4),
       st.booleans())
def test_statistics_with_odd_values_equal_json_logs(tmp_path: Path, edits: list[dict[str, str]], stats: bool) -> None:
    base = {"conversation_id": '"c"', "ttft_ms": "1.5", "latency_ms": "2", "start_time_ms": "3",
            "input_num_turns": "1", "input_num_tokens": "4", "output_num_tokens": "5"}
    lines = ["{" + ", ".join(f'"{k}": {v}' for k, v in {**base, **edit}.items()) + "}" for edit in edits]
    path = tmp_path / "client-stats.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    got, want = _stats_both_ways(path, _STAT_FIELDS, stats=stats)
    assert _same(got) == _same(want), lines


def test_a_statistic_s_count_past_a_64_bit_word_is_no_count() -> None:
    line = ('{"conversation_id": "c", "ttft_ms": 1, "input_num_turns": Infinity, "input_num_tokens": '
            '100000000000000000000, "output_num_tokens": 4611686018427387904, "turn": 1e400}')
    (stat,) = parse_json_numbered([(1, line.encode())], "x")
    assert isinstance(stat, ClientStat)
    assert (stat.input_num_turns, stat.input_num_tokens, stat.output_num_tokens, stat.turn) == \
        (None, None, 1 << 62, None)
    flagged = [r for r in parse_json_numbered([(1, b'{"conversation_id": true, "ttft_ms": 1}')], "x")]
    assert flagged == []  # (true is no id)
    assert [r.conversation_id for r in parse_json_numbered([(1, b'{"conversation_id": 7, "ttft_ms": 1}')], "x")
            if isinstance(r, ClientStat)] == ["7"]


# An event's fields hold values of every JSON type: the engine types each field from its JSON text, and a value of
# another type than the schema's (a string or true for an integer, 5.5 for a count, 7 or ["x"] for an id) makes
# the line json_logs', which counts it corrupt and names the field. DuckDB's own typing once read "5" and true as
# integers and 7 or ["x"] as ids: a line the schema rejects became a turn, and nobody was told.
_EVENT_FIELDS = ("conversation_id", "request_id", "turn", "prompt_tokens", "ttft_ms", "outcome", "attrs")
_EVENT_VALUES = st.sampled_from([*_STAT_LITERALS, '"remote_hit"', '"c\\u00e9"', '"a\\"b"', '{"block_size": 16}'])


def _engine_events(path: Path, columns: tuple[str, ...]) -> tuple[list[tuple[Any, ...]], int]:
    """The engine's events of a JSON lines file as (line number, *columns) of ev, and its corrupt lines."""
    run = engine.new_run([LogFile(str(path), "events", "client")])
    try:
        engine.load_files(run)
        engine.parse(run)
        return run.con.execute(f"SELECT n, {', '.join(columns)} FROM ev ORDER BY n").fetchall(), run.stats.corrupt
    finally:
        run.con.close()


def _events_both_ways(path: Path, columns: tuple[str, ...]
                      ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int, int]:
    """The events of a JSON lines file as (line number, *columns), and the corrupt lines: the engine's, then
    json_logs'."""
    got, corrupt = _engine_events(path, columns)
    stats = LineStats()
    numbered = list(enumerate(path.read_bytes().splitlines(), start=1))
    want = [(r.lineno, *(getattr(r.event, c) for c in columns)) for r in parse_json_numbered(numbered, str(path),
                                                                                            stats)
            if isinstance(r, EventRecord)]
    return got, want, corrupt, stats.corrupt


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.dictionaries(st.sampled_from(_EVENT_FIELDS), _EVENT_VALUES, max_size=3), min_size=1, max_size=5))
def test_events_with_odd_values_equal_json_logs(tmp_path: Path, edits: list[dict[str, str]]) -> None:
    base = {"v": "1", "ts": "1764400000.5", "source": '"client"', "event": '"client_turn"', "conversation_id": '"c"',
            "turn": "1", "request_id": '"r"', "ttft_ms": "12.5", "prompt_tokens": "100"}
    lines = ["{" + ", ".join(f'"{k}": {v}' for k, v in {**base, **edit}.items()) + "}" for edit in edits]
    path = tmp_path / "client.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    columns = ("conversation_id", "request_id", "turn", "prompt_tokens", "ttft_ms", "outcome")
    got, want, corrupt, want_corrupt = _events_both_ways(path, columns)
    assert (got, corrupt) == (want, want_corrupt), lines


def test_an_event_with_a_wrongly_typed_value_is_counted_corrupt_not_read(tmp_path: Path) -> None:
    # the cases DuckDB's typing took, each on its own line after one good event; control: the good line is read
    good = ('{"v": 1, "ts": 1764400000.5, "source": "client", "event": "client_turn", "conversation_id": "c", '
            '"turn": 1, "request_id": "r"}')
    odd = [good.replace('"turn": 1', '"turn": "2"'), good.replace('"turn": 1', '"turn": true'),
           good.replace('"turn": 1', '"turn": 2.5'), good.replace('"conversation_id": "c"', '"conversation_id": 7'),
           good.replace('"conversation_id": "c"', '"conversation_id": ["x"]'),
           good.replace('"turn": 1', '"turn": 9223372036854775808')]
    path = tmp_path / "client.jsonl"
    path.write_text("\n".join([good, *odd]) + "\n", encoding="utf-8")
    got, want, corrupt, want_corrupt = _events_both_ways(path, ("conversation_id", "turn"))
    assert got == want == [(1, "c", 1)]
    assert corrupt == want_corrupt == len(odd)


@pytest.mark.parametrize("block, ttl", [(16, 480), (1 << 63, 1 << 70), (1 << 64, 10 ** 400), (-(1 << 63) - 1, 2.5)],
                         ids=["in range", "past int64", "past uint64 and a double", "below int64"])
def test_an_event_s_attrs_read_as_json_logs_reads_them_as_the_sql_does(tmp_path: Path, block: int, ttl: float) -> None:
    # the same event on a line of its own (the SQL types it) and in an array line (json_logs reads it): the same
    # attrs values. An integer past a 64-bit word once failed the whole run where Python read it (a DuckDB
    # conversion error on insert), and one past a double's range would have (float() of it)
    event = {"v": 1, "ts": 1.0, "source": "decode", "event": "decode_request", "conversation_id": "c", "turn": 1,
             "request_id": "r", "attrs": {"block_size": block, "decoder_kv_blocks_ttl": ttl,
                                          "bidirectional_kv_xfer": True}}
    path = tmp_path / "decode-events.jsonl"
    path.write_text(json.dumps(event) + "\n" + json.dumps([{**event, "turn": 2}]) + "\n", encoding="utf-8")
    got, corrupt = _engine_events(path, ("turn", "attr_block_size", "attr_ttl", "attr_bidir"))
    expect_block = block if -(1 << 63) <= block < (1 << 63) else None
    expect_ttl = float("inf") if ttl == 10 ** 400 else float(ttl)
    assert got == [(1, 1, expect_block, expect_ttl, True), (2, 2, expect_block, expect_ttl, True)]
    assert corrupt == 0
