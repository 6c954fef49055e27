"""report's turn table is explain's, row for row, on event files of every shape (one verdict engine).

"Same" is ``DataFrame.equals`` on the whole table (reasons included) after sorting by turn: the table
``load_turn_table`` builds in the engine against ``build_turn_table`` of the records ``load_turns`` gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvdiag.diagnostics.conversation_ids import id_tags
from kvdiag.diagnostics.report import ReportError, build_turn_table, load_turn_table, normalize_table
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations
from kvdiag.diagnostics.turn_loader import load_turns
from kvdiag.schema.verdicts import Verdict

KEY = ["conversation_id", "turn"]


def _convs() -> list:  # type: ignore[type-arg]
    convs = synthetic_conversations(SynthParams(conversations=60, seed=21, missing_metadata_share=0.1, trim_share=0.3))
    convs[0].turns[1].status = "error"  # the reason then says the turn failed
    convs[2].turns[0].status = "timeout"
    convs[3].turns[1].reason = "inferred: P failed the first leg."  # an inferred outcome, and a trailing dot
    convs[4].turns[1].reason = ""  # no reason: the verdict's summary
    return convs


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    a, b = (x.sort_values(KEY).reset_index(drop=True) for x in (a, b))
    pd.testing.assert_frame_equal(a, b, check_exact=True)  # the message says which column differs
    assert a.equals(b)


def _from_records(files: list[str]) -> pd.DataFrame:
    return build_turn_table(load_turns(files))


@pytest.mark.parametrize("layout", ["router", "router+client", "router+client+duplicate", "no-router-gaps",
                                    "no-router-gaps-or-durations", "client"])
def test_engine_table_equals_explains_records(tmp_path: Path, layout: str) -> None:
    convs = _convs()
    router = list(router_events(convs))
    if layout.startswith("no-router-gaps"):  # the gap must then come from start and duration
        # ...or stay unknown when no event states a duration (gen_logs.py's router events): not 0 s.
        dropped = {"gap_s", "duration_ms"} if layout.endswith("durations") else {"gap_s"}
        router = [json.dumps({k: v for k, v in json.loads(line).items() if k not in dropped}) for line in router]
    files = [] if layout == "client" else [_write(tmp_path / "router-events.jsonl", router)]
    if layout in ("router+client", "router+client+duplicate", "client"):
        client = list(client_events(convs))
        if layout.endswith("duplicate"):
            client.append(client[3])  # a repeated record forces the aggregate (merge) path
        files.append(_write(tmp_path / "client.jsonl", client))
    records_table = _from_records(files)
    assert len(records_table) == sum(len(c.turns) for c in convs)
    _same(load_turn_table(files), records_table)


def test_corrupt_lines_are_skipped_and_a_stock_log_beside_the_events_is_read(tmp_path: Path) -> None:
    convs = _convs()
    lines = list(router_events(convs))
    lines.insert(5, '{"v": 1, "ts": "not a number", broken')
    files = [_write(tmp_path / "router-events.jsonl", lines)]
    table = load_turn_table(files)
    assert len(table) == sum(len(c.turns) for c in convs)
    stock = _write(tmp_path / "decode.log", [
        "(EngineCore_DP0 pid=1) INFO 11-29 06:54:50 [base_scheduler.py:188] Bidirectional KV transfer is enabled "
        "and the kv recompute threshold is set to 64 tokens.KV blocks on D are released after a TTL of 480 seconds."])
    mixed = load_turn_table([*files, stock])  # a stock log beside the events: the same table
    _same(normalize_table(mixed), _from_records([*files, stock]))
    events = load_turn_table([*files, stock], events_only=True)
    assert len(events) == sum(len(c.turns) for c in convs)
    with pytest.raises(ReportError, match="no kvdiag event files"):
        load_turn_table([stock], events_only=True)


def _demo_like(tmp_path: Path, shape: str) -> list[str]:
    """Router + client (+ prefill) events with one shape a real demo run logs (kvdiag demo's conversations)."""
    convs = _convs()
    router = [json.loads(line) for line in router_events(convs)]
    client = [json.loads(line) for line in client_events(convs)]
    prefill = [{"v": 1, "ts": r["ts"], "source": "prefill", "event": "prefill_request", "request_id": r["request_id"],
                "prompt_tokens": r["prompt_tokens"]} for r in router]
    for r, p in zip(router, prefill, strict=True):
        if not r.get("reason", "").startswith("inferred"):  # P's outcome would override an inferred one
            p["outcome"] = r["outcome"]
    if shape == "anonymous":  # demo-anon: the client sent no conversation_id; the router logs none
        del router[0]["conversation_id"], router[1]["conversation_id"]
    elif shape == "concurrent":  # demo-dup: the same turn sent twice, two requests
        router.append({**router[5], "request_id": "dup-" + router[5]["request_id"], "ts": router[5]["ts"] + 0.01})
    elif shape == "inferred":  # the router only inferred the outcome; P's event states what P did
        router[7]["reason"] = "inferred: prefill leg failed"
        prefill[7]["outcome"] = Verdict.EXPIRED_REMOTE_READ.value
    elif shape == "prefill-status":  # P failed the request and the client states no status: P's counts
        prefill[9]["status"] = "error"
        del client[9]["status"]
    elif shape == "prefill-field":  # P states a number neither client nor router does
        router[9].pop("computed_tokens", None)
        prefill[9]["computed_tokens"] = 12
    elif shape == "hashed-tag":  # a router logging the hashed conversation tag instead of the id
        router[2]["conversation_id"] = id_tags(router[2]["conversation_id"])[1]
    elif shape == "prefill-retried":  # P ran a request twice: which event states a field first is file order
        del client[6]["status"], router[6]["computed_tokens"]
        prefill.insert(6, {**prefill[6], "status": "error", "outcome": Verdict.TRANSFER_FAILED.value,
                           "computed_tokens": 7, "reason": "inferred: first attempt"})
        prefill[7]["computed_tokens"] = 8
    elif shape == "unattached-engine-event":
        # an engine event no turn event names, but stating its conversation and turn: a turn of its own
        prefill.append({**prefill[0], "request_id": "nobody-sent-this", "conversation_id": "conv-00000",
                        "turn": 99})
    return [_write(tmp_path / name, [json.dumps(x) for x in rows])
            for name, rows in (("router-events.jsonl", router), ("client.jsonl", client),
                               ("prefill-events.jsonl", prefill))]


@pytest.mark.parametrize("shape", ["inferred", "prefill-status", "prefill-field", "prefill-retried"])
def test_prefill_events_that_change_a_turn_are_modelled(tmp_path: Path, shape: str) -> None:
    # P's event decides where the router only inferred; P's failed status and a field only P states count
    files = _demo_like(tmp_path, shape)
    table = load_turn_table(files)
    records_table = _from_records(files)
    _same(normalize_table(table), records_table)
    if shape == "inferred":
        assert (records_table["verdict"] == Verdict.EXPIRED_REMOTE_READ.value).any()
    if shape == "prefill-status":
        assert (records_table["status"] == "error").any()
    if shape == "prefill-field":
        assert (records_table["computed_tokens"] == 12).any()
    if shape == "prefill-retried":  # the failed first attempt's status stands; the router's outcome decides
        assert (records_table["status"] == "error").any()


@pytest.mark.parametrize("shape", ["anonymous", "concurrent", "unattached-engine-event"])
def test_events_the_correlator_joins_by_request_id_or_turn(tmp_path: Path, shape: str) -> None:
    files = _demo_like(tmp_path, shape)
    _same(load_turn_table(files), _from_records(files))


@pytest.mark.parametrize("how", ["one turn", "every router event"])
def test_hashed_conversation_tags_are_mapped_back_in_sql(tmp_path: Path, how: str) -> None:
    # A router run with --hash-ids logs sha256 tags; the client's events name the ids (correlate maps them).
    files = _demo_like(tmp_path, "hashed-tag")
    if how == "every router event":
        path = Path(files[0])
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows:
            if r["conversation_id"].startswith("conv-"):
                r["conversation_id"] = id_tags(r["conversation_id"])[2]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = load_turn_table(files)
    _same(normalize_table(table), _from_records(files))
    assert set(table["conversation_id"]) == {c.conversation_id for c in _convs()}


def test_redundant_prefill_events_change_nothing(tmp_path: Path) -> None:
    # gen_logs.py's shape: P's events restate what the router says; they change no turn. Nor do the
    # engines' engine_start events, which name no request (the connector writes one per engine).
    files = _demo_like(tmp_path, "plain")
    for role in ("prefill", "decode"):
        with open(tmp_path / f"{role}-events.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"v": 1, "ts": 1.0, "source": role, "event": "engine_start", "model": "m",
                                 "attrs": {"block_size": 16}}) + "\n")
    files = sorted({*files, str(tmp_path / "decode-events.jsonl")})
    table = load_turn_table(files)
    _same(normalize_table(table), _from_records(files))


def test_a_turn_only_stock_logs_show_forces_the_full_parse(tmp_path: Path) -> None:
    convs = _convs()
    files = [_write(tmp_path / "router-events.jsonl", list(router_events(convs)))]
    stats = [{"conversation_id": "stock-only", "turn": 1, "input_num_tokens": 300, "output_num_tokens": 20,
              "ttft_ms": 80.0, "latency_ms": 400.0, "start_time_ms": 1.7e12}]
    files.append(_write(tmp_path / "client-stats.jsonl", [json.dumps(s) for s in stats]))
    table = load_turn_table(files)
    _same(table, _from_records(files))
    assert "stock-only" in set(table["conversation_id"])
    assert len(table) == sum(len(c.turns) for c in convs) + 1


@pytest.mark.parametrize("bad", [
    {"turn": 0}, {"outcome": "no_such_verdict"}, {"v": 2}, {"status": "weird"}, {"ttft_ms": -1.0},
    {"event": "client_turn"},  # a client event name from the router
])
def test_event_lines_explain_rejects_are_skipped_by_both(tmp_path: Path, bad: dict) -> None:  # type: ignore[type-arg]
    # explain counts such a line as corrupt and skips it; so does report's table
    router = [json.loads(line) for line in router_events(_convs())]
    router[4] = {**router[4], **bad}
    files = [_write(tmp_path / "router-events.jsonl", [json.dumps(r) for r in router])]
    table = load_turn_table(files)
    _same(table, _from_records(files))
    assert len(table) == len(router) - 1


def test_a_statistics_line_in_an_event_file_is_read_as_one(tmp_path: Path) -> None:
    lines = list(router_events(_convs()))
    lines.append(json.dumps({"conversation_id": "conv-00001", "ttft_ms": 12.0, "input_num_turns": 1}))
    files = [_write(tmp_path / "router-events.jsonl", lines)]
    _same(load_turn_table(files), _from_records(files))
