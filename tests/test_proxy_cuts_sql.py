"""The proxy groups the engine reads equal the proxy parser's groups, on ids built to trip a wrong reading.

The engine tells a line's kind by the text after its id (the message's first ``]`` or ``": "``) and reads the
groups with a one-pass form of the pattern (the conversation id read greedily up to the space); ids holding
those characters (where the pattern allows them) are where a wrong reading would show.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from engine_lines_support import insert_lines

from kvdiag.diagnostics import engine_parse as ep
from kvdiag.diagnostics import engine_proxy
from kvdiag.diagnostics.proxy_log_parser import parse_proxy_numbered

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "logs"
HEAD = "2025-11-29 06:55:00 [INFO] disagg_proxy: "
GREEDY_CONV = ep._re2(re.compile(r"conv=(?P<conv>\S+) "))  # the one-pass forms' conversation id, as RE2 reads it
# a request id may hold ": ", " conv=", ": cache MISS" and "[" (only "]" ends it); a conversation id any
# character but whitespace (":", "]", ")", ",", "(" included)
RIDS = ["r1", "a: b", "x] conv=y: cache MISS", "[q: r", "é: ü", "k) (age=1s", "z, blocks=3)", "(remote_request_id=q"]
CONVS = ["c1", "a:b", "x]y", "p(q)", "a,b", "é:]", "conv=d:", "m:s", "x(remote_request_id=y", "(remote_request_id=z,"]
ADVERSARIAL = [
    *(f"[{r}] conv={c}: cache MISS" for r in RIDS for c in CONVS),
    *(f"[{r}] conv={c}: cache MISS (prefix changed: x)" for r in RIDS for c in CONVS),
    *(f"[{r}] conv={c}: sending D's cached blocks to P (remote_request_id=cmpl-{r}-1)" for r in RIDS for c in CONVS),
    *(f"[{r}] conv={c}: no D-to-P handle offered" for r in RIDS for c in CONVS),
    *(f"[{r}] Prefill done in 1.5ms" for r in RIDS),
    *(f"[{r}] Prefill request failed: boom: x] y" for r in RIDS),
    *(f"conv={c}: cache HIT (age=3.5s)" for c in CONVS),
    *(f"conv={c}: stale cache entry (age=9.0s > ttl=4.5s), discarding" for c in CONVS),
    *(f"conv={c}: cached D blocks (remote_request_id=chatcmpl-{c}-1, blocks=7)" for c in CONVS),
    "conv=c: cached D blocks (remote_request_id=a(b, blocks=7)", "[r] conv=c: cache MISS ()",
    # (a remote request id, and the text after the pattern, may hold ": ")
    "conv=c: cached D blocks (remote_request_id=a: b, blocks=7)", "conv=c: cache HIT (age=3.5s): then x",
    "[r] conv=c: cache MISS (why", "[r]] conv=c: cache MISS", "[] conv=c: cache MISS", "conv=: cache HIT (age=1s)",
    "conv=a b: cache HIT (age=1s)", "[r] conv=a b: cache MISS", "[r] Prefill done in ms", "conv=c cache HIT (age=1s)",
    "[r] conv=c cache MISS", "conv=c cached D blocks (remote_request_id=a, blocks=7)",
]


def _pl(lines: list[str]) -> dict[int, tuple[object, ...]]:
    con = duckdb.connect()
    ep.create_line_tables(con)
    insert_lines(con, "lines_proxy", list(enumerate(lines, start=1)), "proxy.log")
    for q in ep.parse_proxy_sql():
        con.execute(q)
    rows = con.execute("SELECT n, kind, rid, conv, remote, age, ttl, nullif(why, ''), ms, detail, blocks, p, d, ts "
                       "FROM pl").fetchall()
    return {row[0]: row[1:] for row in rows}


def _want(lines: list[str]) -> dict[int, tuple[object, ...]]:
    want = {}
    for rec in parse_proxy_numbered(list(enumerate(lines, start=1)), "proxy.log"):
        fl = rec.fields
        want[rec.lineno] = (rec.kind, fl.get("rid"), fl.get("conv"), fl.get("remote"), fl.get("age"), fl.get("ttl"),
                            fl.get("why") or None, fl.get("ms"), fl.get("detail"), fl.get("blocks"), fl.get("p"),
                            fl.get("d"), rec.ts)
    return want


def _fixture_lines() -> list[str]:
    return [line.rstrip("\r") for path in sorted(FIXTURES.rglob("proxy*.log"))
            for line in path.read_text(encoding="utf-8", errors="replace").split("\n") if line]


def test_cut_groups_equal_the_parser_on_adversarial_ids() -> None:
    lines = [HEAD + m for m in ADVERSARIAL]
    want = _want(lines)
    assert len(want) > 250  # nearly every line above is one the patterns accept
    assert _pl(lines) == want


def test_cut_groups_equal_the_parser_on_the_fixture_logs() -> None:
    lines = _fixture_lines()
    want = _want(lines)
    assert len(want) > 100
    assert _pl(lines) == want


@pytest.mark.parametrize(("kind", "wrong"), [
    # the negative controls of the one-pass forms: a request id read up to the last "]" instead of the first, a
    # conversation id read lazily up to its first ":" (an id may hold one)
    ("miss", lambda form: form.replace(r"(?P<rid>[^\]]+)", r"(?P<rid>.+)")),
    ("cached", lambda form: form.replace(GREEDY_CONV, r"conv=(?P<conv>[^:]+:) ")),
])
def test_a_wrong_form_is_caught(monkeypatch: pytest.MonkeyPatch, kind: str, wrong: Callable[[str], str]) -> None:
    lines = [HEAD + m for m in ADVERSARIAL]
    assert wrong(engine_proxy._FORMS[kind]) != engine_proxy._FORMS[kind]
    monkeypatch.setitem(engine_proxy._FORMS, kind, wrong(engine_proxy._FORMS[kind]))
    assert _pl(lines) != _want(lines)


@pytest.mark.parametrize("wrong", [
    # the negative controls of the greedy conversation id's check: without its ":" (the line has no ": " after the
    # id), without its length (the id is empty)
    "{0} <> ''", "ends_with({0}, ':')",
])
def test_a_wrong_conversation_id_check_is_caught(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    lines = [HEAD + m for m in ADVERSARIAL]
    monkeypatch.setattr(engine_proxy, "_CONV_READ", wrong)
    assert _pl(lines) != _want(lines)


@pytest.mark.parametrize(("lead", "wrong"), [
    # the negative controls of the id's end that the kind tests and the cuts read: the message's last "]" or
    # ": " instead of the first
    ("[", "length(msg) - strpos(reverse(msg), ']') + 1"),
    ("c", "length(msg) - strpos(reverse(msg), ' :')"),
])
def test_a_wrong_id_end_is_caught(monkeypatch: pytest.MonkeyPatch, lead: str, wrong: str) -> None:
    lines = [HEAD + m for m in ADVERSARIAL]
    monkeypatch.setitem(engine_proxy._ID_END, lead, wrong)
    assert _pl(lines) != _want(lines)


def test_the_kind_tests_alone_do_not_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    # the control for the tests before each pattern: without the pattern, lines the tests pass but the pattern
    # rejects (a conversation id with a space, a time without digits) would take a kind
    lines = [HEAD + m for m in ADVERSARIAL]
    assert _pl(lines) == _want(lines)
    monkeypatch.setattr(engine_proxy, "_matched", lambda x, regex: "true")
    assert _pl(lines) != _want(lines)
