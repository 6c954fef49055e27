"""Several proxy logs: replicas of the router (a cluster sharing its store), each logging the requests it served.

A conversation's requests are spread over the replicas' logs. Its turns are numbered, and its previous turn found,
in the order of the lines' times (each log's own order kept), not log after log.
"""

from __future__ import annotations

import random
import re
import shutil
import time
from pathlib import Path

import duckdb
import pytest
from gen_logs_support import load_gen_logs, stock_only

import kvdiag
from kvdiag.diagnostics.records import ConversationRecord

_RID = re.compile(r": \[([0-9a-f]+)\] (?:conv=(.*?): )?")
_STORED = re.compile(r"cached D blocks \(remote_request_id=(?:chat)?cmpl-([0-9a-f]+)-")
_HEAD = re.compile(r": conv=(.*?): (?:cache HIT|cache MISS|stale cache entry)")


def _one_second_apart(proxy_log: Path) -> None:
    """Each line stamped a second after the one before it (the generated log packs a run into seconds): the times
    then tell the order of any two lines."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    t0 = 1_764_400_000
    proxy_log.write_text("".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0 + i)) + line[19:]
                                 for i, line in enumerate(lines)), encoding="utf-8")


def _milliseconds_apart(proxy_log: Path) -> None:
    """Each line stamped a millisecond after the one before it, as ``%(asctime)s`` writes a stamp (",123"): many
    lines share a second, and only the fractions tell their order."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    t0 = 1_764_400_000_000
    proxy_log.write_text("".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime((t0 + i) // 1000))
                                 + f",{(t0 + i) % 1000:03d}" + line[19:] for i, line in enumerate(lines)),
                         encoding="utf-8")


def _iso_stamps(log: Path) -> None:
    """The stamps written ISO-style ("T" between the date and the time, "." before the fraction), as another
    replica's logging configuration may write them."""
    text = log.read_text(encoding="utf-8")
    iso = re.sub(r"^(\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d),?",
                 lambda m: m[1] + "T" + m[2] + "." * m[0].endswith(","), text, flags=re.M)
    log.write_text(iso, encoding="utf-8")


def _split_by_request(proxy_log: Path, out: list[Path], rng: random.Random) -> None:
    """Each request's lines (its lookup line, its own lines, its stored handle) into one replica's log, drawn at
    random; the startup line into every log."""
    lines = proxy_log.read_text(encoding="utf-8").splitlines(keepends=True)
    owner: dict[int, str] = {}
    waiting: dict[str, list[int]] = {}  # a conversation's lookup lines, before its request's first own line
    for i, line in enumerate(lines):
        if m := _RID.search(line):
            owner[i] = m.group(1)
            for j in waiting.pop(m.group(2) or "", []):
                owner[j] = m.group(1)
        elif m := _STORED.search(line):
            owner[i] = m.group(1)
        elif m := _HEAD.search(line):
            waiting.setdefault(m.group(1), []).append(i)
    replica: dict[str, int] = {}
    texts: list[list[str]] = [[] for _ in out]
    for i, line in enumerate(lines):
        if i in owner:
            texts[replica.setdefault(owner[i], rng.randrange(len(out)))].append(line)
        else:
            for t in texts if "Ready: " in line else texts[:1]:
                t.append(line)
    proxy_log.unlink()
    for path, t in zip(out, texts, strict=True):
        path.write_text("".join(t), encoding="utf-8")


def _verdicts(folder: Path) -> dict[tuple[str, int], tuple[str, str | None, float | None]]:
    return {(c.conversation_id, t.turn): (t.verdict.value, t.request_id, t.entry_age_s)
            for c in kvdiag.load_turns([str(folder)]) for t in c.turns}


def _stock_set(folder: Path, size: int, seed: int, **options: float) -> None:
    """A generated run's stock logs alone (the proxy's lines alone order a conversation's requests)."""
    load_gen_logs().generate(folder, size, seed=seed, noise_per_turn=1, **options)
    stock_only(folder)


def _assert_one_conversation_as_all(folder: Path, conversations: list[ConversationRecord]) -> None:
    for conv in conversations:
        alone = kvdiag.explain_conversation([str(folder)], conv.conversation_id)
        assert [t.__dict__ for t in alone.turns] == [t.__dict__ for t in conv.turns]


def _assert_split_reads_as_one(one: Path, split: Path, conversations: int) -> dict[
        tuple[str, int], tuple[str, str | None, float | None]]:
    """The split set gives the one-log set's verdicts, and its first conversations one at a time as ``--all``."""
    want = _verdicts(one)
    assert len(want) > 40
    assert _verdicts(split) == want
    _assert_one_conversation_as_all(split, kvdiag.load_turns([str(split)])[:conversations])
    return want


@pytest.mark.parametrize(("seed", "iso"), [(2, False), (4, True)])
def test_turns_spread_over_replicas_logs_are_the_turns_of_one_log(tmp_path: Path, seed: int, iso: bool) -> None:
    one, split = tmp_path / "one", tmp_path / "split"
    _stock_set(one, 300_000, seed)
    _one_second_apart(one / "proxy.log")
    shutil.copytree(one, split)
    _split_by_request(split / "proxy.log", [split / "proxy-a.log", split / "proxy-b.log"], random.Random(seed))
    if iso:  # (a replica writing its stamps another way)
        _iso_stamps(split / "proxy-b.log")
    want = _assert_split_reads_as_one(one, split, 4)
    table = kvdiag.load_turn_table([str(split)])
    assert sorted(zip(table["conversation_id"], table["turn"], table["verdict"], strict=True)) == sorted(
        (c, t, v[0]) for (c, t), v in want.items())


def test_lines_of_one_second_keep_each_logs_order(tmp_path: Path) -> None:
    # the generated run packs its requests into a few seconds: within a second, each log's own order holds, and
    # a single log reads as it did
    _stock_set(tmp_path, 300_000, 3)
    before = _verdicts(tmp_path)
    renamed = tmp_path / "replica-0.log"
    (tmp_path / "proxy.log").rename(renamed)
    assert _verdicts(tmp_path) == before


def test_fractions_of_a_second_order_the_replicas_lines(tmp_path: Path) -> None:
    # the stamps' fractions order the lines of one second across the logs, whichever way each log writes them
    one, split = tmp_path / "one", tmp_path / "split"
    _stock_set(one, 300_000, 5)
    _milliseconds_apart(one / "proxy.log")
    shutil.copytree(one, split)
    logs = [split / "proxy-a.log", split / "proxy-b.log"]
    _split_by_request(split / "proxy.log", logs, random.Random(5))
    _iso_stamps(logs[1])
    _assert_split_reads_as_one(one, split, 4)


def test_within_a_second_ps_log_orders_the_replicas_requests(tmp_path: Path) -> None:
    # the generated run packs about ten requests into each whole second, spread over two replicas: P's request log
    # ("Received request", one file) tells their order, as one proxy log would
    one, split = tmp_path / "one", tmp_path / "split"
    _stock_set(one, 300_000, 2)
    shutil.copytree(one, split)
    _split_by_request(split / "proxy.log", [split / "proxy-a.log", split / "proxy-b.log"], random.Random(2))
    want = _assert_split_reads_as_one(one, split, 6)
    # without P's request log nothing tells the order within a second: the logs' order stands, and turns move
    # (the control: the split above does put requests of one conversation and second on both replicas)
    prefill = split / "prefill.log"
    prefill.write_text("".join(line for line in prefill.read_text(encoding="utf-8").splitlines(keepends=True)
                               if "Received request" not in line), encoding="utf-8")
    assert _verdicts(split) != want


def _request_order(requests: list[tuple[str, str, int, int, str]], received: list[tuple[int, int, str]],
                   offered: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Each conversation's requests in the order the replicas' statement gives them. ``requests``: (rid, conv,
    proxy log, po, stamp); ``received``: P's "Received request" lines (file, line, rid), file 0 and 1 being P's;
    ``offered``: the request whose handle a request was offered, by request."""
    from kvdiag.diagnostics import engine_join

    con = duckdb.connect()
    for q in engine_join.MACROS:
        if not isinstance(q, engine_join.FewRowsOnly):
            con.execute(q)
    con.execute("CREATE TABLE px_req (rid VARCHAR, conv VARCHAR, po BIGINT, seq BIGINT, stamp VARCHAR, "
                "offered VARCHAR)")
    handle = {rid: f"chatcmpl-{prev}-0a1b2c3d" for rid, prev in (offered or {}).items()}
    con.executemany("INSERT INTO px_req VALUES (?, ?, ?, ?, ?, ?)",
                    [(rid, conv, po, (log << 40) + po, stamp, handle.get(rid))
                     for rid, conv, log, po, stamp in requests])
    con.execute("CREATE TABLE froles AS SELECT * FROM (VALUES (0, 'prefill'), (1, 'prefill')) v(f, role)")
    con.execute("CREATE TABLE vl (f INTEGER, n BIGINT, kind VARCHAR, request_id VARCHAR)")
    for f, n, rid in received:
        con.execute("INSERT INTO vl VALUES (?, ?, 'received_request', ?)", (f, n, f"chatcmpl-{rid}"))
    con.execute(engine_join._REPLICAS_ORDER_SQL)
    order: dict[str, list[str]] = {}
    for rid, conv in con.execute("SELECT rid, conv FROM px_order ORDER BY conv, gpo, inner_key").fetchall():
        order.setdefault(conv, []).append(rid)
    return order


def test_ps_order_only_where_it_is_whole_and_agrees_with_every_log() -> None:
    s = "2025-11-29 07:06:40"
    order = _request_order(
        [("a1", "a", 0, 1, s), ("a2", "a", 1, 2, s),  # P received a2 first: P's order
         ("b1", "b", 0, 3, s), ("b2", "b", 0, 4, s), ("b3", "b", 1, 5, s),  # P's order breaks log 0's: the lines'
         ("c1", "c", 0, 6, s), ("c2", "c", 1, 7, s),  # c1 unseen by P: the lines' order
         ("d1", "d", 0, 8, s), ("d2", "d", 1, 9, s),  # two P logs: the lines' order
         ("e1", "e", 0, 10, s), ("e2", "e", 0, 11, s),  # one proxy log: its order, whatever P says
         ("f1", "f", 0, 12, s), ("f2", "f", 1, 13, "2025-11-29 07:06:41")],  # two stamps: the stamps' order
        [(0, 20, "a1"), (0, 10, "a2"), (0, 30, "b1"), (0, 25, "b2"), (0, 28, "b3"), (0, 40, "c2"),
         (0, 50, "d2"), (1, 5, "d1"), (0, 61, "e2"), (0, 62, "e1"), (0, 71, "f2"), (0, 72, "f1")])
    assert order == {"a": ["a2", "a1"], "b": ["b1", "b2", "b3"], "c": ["c1", "c2"], "d": ["d1", "d2"],
                     "e": ["e1", "e2"], "f": ["f1", "f2"]}


def test_without_ps_log_a_hit_comes_after_the_request_whose_handle_it_read() -> None:
    s, t = "2025-11-29 07:06:40", "2025-11-29 07:06:41"
    order = _request_order(
        [("a2", "a", 0, 1, s), ("a1", "a", 1, 2, s),  # a2 read a1's handle
         ("b2", "b", 0, 3, s), ("b3", "b", 0, 4, s), ("b1", "b", 1, 5, s),  # b3 read b2's, b2 read b1's
         ("c2", "c", 0, 6, s), ("c1", "c", 1, 7, s),  # c2 read a handle of an earlier second: the lines' order
         # d2 read d1's handle, but d9 comes after d2 in log 0 and nothing puts d9 after d1: the lines' order
         ("d2", "d", 0, 8, s), ("d9", "d", 0, 9, s), ("d1", "d", 1, 10, s),
         ("e1", "e", 0, 11, s), ("e2", "e", 1, 12, s), ("e0", "e", 1, 13, s),  # e1 and e2 each other's: no chain
         ("g1", "g", 0, 14, s), ("g3", "g", 0, 15, s), ("g2", "g", 1, 16, s),  # g3 read g2's, g2 read g1's
         # h4 read h1's handle, a second before: within its own second nothing orders it
         ("h1", "h", 0, 17, s), ("h2", "h", 1, 18, s), ("h4", "h", 1, 19, t), ("h3", "h", 0, 20, t)],
        [], {"a2": "a1", "b3": "b2", "b2": "b1", "c2": "c0", "d2": "d1", "e1": "e2", "e2": "e1", "g3": "g2",
             "g2": "g1", "h4": "h1"})
    assert order == {"a": ["a1", "a2"], "b": ["b1", "b2", "b3"], "c": ["c2", "c1"], "d": ["d2", "d9", "d1"],
                     "e": ["e1", "e2", "e0"], "g": ["g1", "g2", "g3"], "h": ["h1", "h2", "h4", "h3"]}


def test_one_conversation_reads_the_windows_of_an_iso_stamped_replica(tmp_path: Path) -> None:
    # one conversation's explain reads the proxy lines of the minutes around its reads, which P's stats windows
    # share with other conversations' reads: those of a replica writing "T" in its stamps count too
    _stock_set(tmp_path, 600_000, 1, stat_interval=10.0)
    logs = [tmp_path / "proxy-a.log", tmp_path / "proxy-b.log", tmp_path / "proxy-c.log"]
    _split_by_request(tmp_path / "proxy.log", logs, random.Random(1))
    _iso_stamps(logs[1])
    convs = kvdiag.load_turns([str(tmp_path)])
    windowed = [c for c in convs if any("stats window" in (t.reason or "") for t in c.turns)]
    assert len(windowed) >= 3
    _assert_one_conversation_as_all(tmp_path, windowed[:8])
