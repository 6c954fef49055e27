"""report's table over events + stock logs is explain's, row for row: one verdict engine for every shape.

The data sets are benchmarks/gen_logs.py's (stock vLLM, proxy and client-stats logs beside router,
client and prefill events), then reshaped one way per case (formerly shapes one of two copies of the
rules did not model); each must give explain's table (``DataFrame.equals``) and what the stock logs add.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from gen_logs_support import load_gen_logs, stock_only
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics import engine_parse
from kvdiag.diagnostics.proxy_log_parser import parse_proxy_log
from kvdiag.diagnostics.report import build_turn_table, load_turn_table, normalize_table
from kvdiag.diagnostics.turn_loader import load_turns

KEY = ["conversation_id", "turn"]


GEN = load_gen_logs()


def _generate(out: Path, seed: int = 0, size: int = 250_000) -> Path:
    GEN.generate(out, size, seed=seed, noise_per_turn=2)
    return out


def _files(out: Path) -> list[str]:
    return sorted(str(p) for p in out.iterdir())


def _parsed(files: list[str]) -> pd.DataFrame:
    return build_turn_table(load_turns(files))


def _same(fast: pd.DataFrame, slow: pd.DataFrame) -> None:
    a = normalize_table(fast).sort_values(KEY).reset_index(drop=True)
    b = slow.sort_values(KEY).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=True)  # the message names the column that differs
    assert a.equals(b)


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a corrupt line another reshaping appended
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _append(path: Path, *lines: str) -> None:
    with path.open("a", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)


def _router(out: Path) -> list[dict]:  # type: ignore[type-arg]
    return _jsonl(out / "router-events.jsonl")


def _engine_id(out: Path, rid: str) -> str:
    return next(e["engine_request_id"] for e in _jsonl(out / "prefill-events.jsonl") if e["request_id"] == rid)


# ----- reshapings that keep the DuckDB path ---------------------------------------------------------------

def _client_status(out: Path) -> None:
    # answered turns (P's failed first attempt then extends the reason) and a few failed ones
    rows = _jsonl(out / "client.jsonl")
    for i, r in enumerate(rows):
        r["status"] = "error" if i % 17 == 5 else "ok"
    _write_jsonl(out / "client.jsonl", rows)


def _proxy_failed_legs(out: Path) -> None:
    hits = [r for r in _router(out) if r["outcome"] == "remote_hit"][:6]
    _append(out / "proxy.log", *(f"2025-11-29 06:55:0{i} [INFO] disagg_proxy: [{r['request_id']}] "
                                 f"{'Decode' if i % 2 else 'Prefill'} request failed: HTTP 500 boom {i}"
                                 for i, r in enumerate(hits)))


def _engine_failure_lines(out: Path) -> None:
    hits = [r for r in _router(out) if r["outcome"] == "remote_hit"][6:12]
    ids = [_engine_id(out, r["request_id"]) for r in hits]
    _append(out / "decode.log",
            f"(APIServer pid=2) ERROR 11-29 06:54:50 [async_llm.py:500] Request {ids[0]} failed (engine dead).",
            f"(APIServer pid=2) ERROR 11-29 06:54:50 [async_llm.py:500] Request {ids[1]} failed.",
            # explain's keyword prefilter does not keep this one: neither path may count it
            f"(APIServer pid=2) ERROR 11-29 06:54:50 [async_llm.py:500] Request {ids[2]} failed: boom",
            f"(APIServer pid=2) INFO 11-29 06:54:50 [logger.py:77] Generated response {ids[3]}: output: 'x', "
            "output_token_ids: [1], finish_reason: abort",
            f"(APIServer pid=2) INFO 11-29 06:54:50 [logger.py:77] Generated response {ids[4]}: output: 'y', "
            "output_token_ids: [1], finish_reason: stop",
            "Traceback (most recent call last): the KV load failed")


def _unknown_roles(out: Path) -> None:
    # no role in the names: P's file is P's by its "Declining expired" lines, D's stays of unknown role
    (out / "prefill.log").rename(out / "engine-a.log")
    (out / "decode.log").rename(out / "engine-b.log")


def _crlf_proxy(out: Path) -> None:
    path = out / "proxy.log"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))


def _gzipped(out: Path) -> None:
    for p in list(out.iterdir()):
        with p.open("rb") as src, gzip.open(str(p) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        p.unlink()


def _stats_document(out: Path) -> None:
    # vLLM's --stats-json-output: one JSON array; numeric conversation ids and float counts too
    rows = _jsonl(out / "client-stats.jsonl")
    (out / "client-stats.jsonl").unlink()
    rows[0]["input_num_turns"] = float(rows[0]["input_num_turns"]) + 0.7
    (out / "client-stats.json").write_text(json.dumps([*rows, 7, {"no": "conversation"}], indent=2))


def _corrupt_stats_line(out: Path) -> None:
    _append(out / "client-stats.jsonl", '{"conversation_id": "CONV_ID_1", "ttft_ms": ')


def _lone_cr_proxy(out: Path) -> None:
    # both readers split at the CR: two records either way
    rid = _router(out)[2]["request_id"]
    head = "2025-11-29 06:55:00 [INFO] disagg_proxy:"
    _append(out / "proxy.log", f"{head} conv=CONV_ID_1: cache HIT (age=3.0s)\r{head} [{rid}] Prefill done in 12ms")


KEEPS: dict[str, Callable[[Path], None]] = {
    "as generated": lambda out: None, "client statuses": _client_status, "proxy failed legs": _proxy_failed_legs,
    "engine failure lines": _engine_failure_lines, "files of unknown role": _unknown_roles,
    "CRLF proxy log": _crlf_proxy, "gzip": _gzipped,
    "stats document": _stats_document, "corrupt stats line": _corrupt_stats_line,
}


@pytest.mark.parametrize("shape", list(KEEPS))
def test_stock_beside_events_gives_explains_table(tmp_path: Path, shape: str) -> None:
    out = _generate(tmp_path / "run", seed=len(shape))
    KEEPS[shape](out)
    files = _files(out)
    fast = load_turn_table(files)
    slow = _parsed(files)
    _same(fast, slow)
    # the stock logs did change the table: this is no events-only table
    assert slow["completion_tokens"].notna().all() and slow["prefill_ms"].notna().any()
    assert slow["entry_age_s"].notna().any() and slow["reason"].str.contains("KV load failure").any()
    if shape == "client statuses":
        assert slow["reason"].str.contains("yet the client got its answer").any()
    if shape == "proxy failed legs":
        assert slow["reason"].str.contains("decode failed: HTTP 500 boom").any()
    if shape == "engine failure lines":
        assert slow["reason"].str.contains(r"vLLM: request failed \(engine dead\)").any()
        assert slow["reason"].str.contains("finish_reason=abort").any()


# ----- reshapings the DuckDB path declines (the parser's table, through load_turn_table) ------------------

def _explicit_turns(out: Path) -> None:
    rows = _jsonl(out / "client-stats.jsonl")
    rows[0]["turn"] = 1
    _write_jsonl(out / "client-stats.jsonl", rows)


def _orphan_stats(out: Path) -> None:
    rows = _jsonl(out / "client-stats.jsonl")
    _write_jsonl(out / "client-stats.jsonl", [*rows, {**rows[0], "conversation_id": "nobody"}])


def _tied_stats(out: Path) -> None:
    rows = _jsonl(out / "client-stats.jsonl")
    _write_jsonl(out / "client-stats.jsonl", [*rows, rows[-1]])


def _hang_lines(out: Path) -> None:
    rid = _engine_id(out, _router(out)[3]["request_id"])
    _append(out / "prefill.log", f"(EngineCore_DP0 pid=11) DEBUG 11-29 06:54:50 [distributed/nixl/base_worker.py:900] "
                                 f"{rid} is still in WAITING_FOR_REMOTE_KVS state.")


def _cr_vllm(out: Path) -> None:
    # vllm_log joins a line ending in CR to the next (same time and level): explain's records may differ
    failing = next(ln for ln in (out / "prefill.log").read_text().splitlines() if "due to KV load failure" in ln)
    _append(out / "prefill.log", failing[:failing.index("Failing")] + "progress 100%\r", failing)


def _hashed_proxy_conv(out: Path) -> None:
    tag = hashlib.sha256(b"CONV_ID_2").hexdigest()[:16]
    _append(out / "proxy.log", f"2025-11-29 06:55:00 [INFO] disagg_proxy: conv={tag}: cache HIT (age=3.0s)")


def _unknown_proxy_request(out: Path) -> None:
    _append(out / "proxy.log", "2025-11-29 06:55:00 [INFO] disagg_proxy: [nobody-sent-it] conv=CONV_ID_1: cache MISS")


def _bad_utf8_proxy(out: Path) -> None:
    with (out / "proxy.log").open("ab") as fh:
        fh.write(b"2025-11-29 06:55:00 [INFO] disagg_proxy: conv=CONV_ID_1: cache HIT (age=\xff1.0s)\n")


def _array_line_in_stats(out: Path) -> None:
    rows = _jsonl(out / "client-stats.jsonl")
    lines = [json.dumps(r) for r in rows[:-2]] + [json.dumps(rows[-2:])]
    (out / "client-stats.jsonl").write_text("\n".join(lines) + "\n")


DECLINES: dict[str, Callable[[Path], None]] = {
    "stats with explicit turns": _explicit_turns, "stats for no event's conversation": _orphan_stats,
    "tied stats": _tied_stats, "WAITING_FOR_REMOTE_KVS lines": _hang_lines, "CR-continued vLLM line": _cr_vllm,
    "hashed proxy conversation": _hashed_proxy_conv, "proxy request no event names": _unknown_proxy_request,
    "invalid UTF-8": _bad_utf8_proxy, "stock logs alone": stock_only, "array line in stats": _array_line_in_stats,
    "CR inside a proxy line": _lone_cr_proxy,
}


@pytest.mark.parametrize("shape", list(DECLINES))
def test_other_shapes_give_explains_table_too(tmp_path: Path, shape: str) -> None:
    out = _generate(tmp_path / "run", seed=3)
    DECLINES[shape](out)
    files = _files(out)
    _same(load_turn_table(files), _parsed(files))


def test_an_entry_age_comes_from_the_hit_line_just_before_the_lookup(tmp_path: Path) -> None:
    # correlate's pending rule: a later HIT of the same conversation replaces an earlier one, and a lookup
    # of another conversation in between takes nothing from it
    out = _generate(tmp_path / "run", seed=5)
    lines = (out / "proxy.log").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ": sending D's cached blocks" in ln)
    conv = lines[at].split("conv=")[1].split(":")[0]
    head = lines[at][:lines[at].index("disagg_proxy:") + len("disagg_proxy:")]
    lines[at:at] = [f"{head} conv={conv}: cache HIT (age=77.5s)", f"{head} conv=OTHER: cache HIT (age=1.0s)"]
    (out / "proxy.log").write_text("\n".join(lines) + "\n")
    files = _files(out)
    fast = load_turn_table(files)
    _same(fast, _parsed(files))
    assert (fast["entry_age_s"] == 77.5).sum() == 1


# ----- the proxy lines: DuckDB's kinds and groups are the parser's ------------------------------------------

# Mostly ids the patterns accept (so most examples compare records), sometimes one they reject.
_ID = st.one_of(st.text(st.sampled_from("ab9_-.:()=x/é"), min_size=1, max_size=8),
                st.text(st.sampled_from("ab9 ]["), min_size=0, max_size=4))
_NUMBER = st.sampled_from(["12", "3.5", "0.25", "1.2.3", ".5", "7.", "", "x"])
_TEMPLATES = (
    "conv={c}: stale cache entry (age={n}s > ttl={n}s), discarding", "conv={c}: cache HIT (age={n}s)",
    "conv={c}: cached D blocks (remote_request_id={r}, blocks=3)", "[{r}] No conversation_id provided",
    "[{r}] conv={c}: sending D's cached blocks to P (remote_request_id={r})", "[{r}] conv={c}: cache MISS",
    "[{r}] conv={c}: no D-to-P handle offered", "[{r}] Prefill done in {n}ms", "[{r}] Prefill request failed: {c}",
    "[{r}] Decode request failed: {r}", "Ready: 1 prefill, 1 decode instances",
)
_FIELDS = ("rid", "conv", "age", "ms", "detail")


# derandomize: the same examples on every CI run (600 random ones passed while this was written)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(_TEMPLATES), _ID, _ID, _NUMBER, st.booleans()), min_size=1, max_size=12))
def test_proxy_kinds_and_groups_match_the_parser(tmp_path: Path, rows: list[tuple[str, str, str, str, bool]]) -> None:
    lines = [("2025-11-29 06:55:00 [INFO] disagg_proxy: " if proxy else "garbage ") + t.format(c=c, r=r, n=n)
             for t, c, r, n, proxy in rows]
    path = tmp_path / "proxy.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    want = [(rec.kind, *(rec.fields.get(f) for f in _FIELDS)) for rec in parse_proxy_log(lines, str(path))
            if rec.kind not in ("cached", "no_conversation_id", "ready")]
    con = duckdb.connect()
    try:
        engine_parse.create_line_tables(con)
        con.execute(engine_parse.read_lines_sql("lines_proxy", 0, str(path)))
        for q in engine_parse.parse_proxy_sql():
            con.execute(q)
        got = [tuple(row) for row in con.sql(f"SELECT kind, {', '.join(_FIELDS)} FROM pl "
                                             "WHERE kind NOT IN ('cached', 'no_conversation_id', 'ready') ORDER BY f, n"
                                             ).fetchall()]
    finally:
        con.close()
    assert got == want


# derandomize: the same examples on every CI run (300 random ones passed while this was written)
@pytest.mark.slow
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), shapes=st.sets(st.sampled_from(sorted(set(KEEPS) - {"as generated", "gzip"})),
                                                   max_size=4), gz=st.booleans())
def test_combined_reshapings_stay_equal(tmp_path_factory: pytest.TempPathFactory, seed: int, shapes: set[str],
                                        gz: bool) -> None:
    out = _generate(tmp_path_factory.mktemp("combo"), seed=seed)
    for shape in sorted(shapes):
        KEEPS[shape](out)
    if gz:
        _gzipped(out)
    files = _files(out)
    _same(load_turn_table(files), _parsed(files))



@pytest.mark.parametrize("seed", [0, 192])
def test_a_lone_cr_in_a_crlf_proxy_log_keeps_every_line(tmp_path: Path, seed: int) -> None:
    # DuckDB read "\r2025-..." as a CRLF line end plus "025-..." on seed 192's file: the line was lost
    out = _generate(tmp_path / "run", seed=seed)
    _lone_cr_proxy(out)
    _crlf_proxy(out)
    files = _files(out)
    _same(load_turn_table(files), _parsed(files))
