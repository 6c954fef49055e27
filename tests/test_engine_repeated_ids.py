"""A request id several client statistics repeat (a client that reuses its ids, or stamps one id on retries) gives
one slot per statistic: the engine then holds several slots for one id, and every join by request id must keep
each turn once, whichever path reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvdiag
from kvdiag.diagnostics import verdict_engine
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.report import load_turn_arrow
from kvdiag.diagnostics.turn_loader import run_all

_STATS = [
    ("CONV_A", "dup-1", 1, 1764399301000.0),
    ("CONV_A", "dup-1", 3, 1764399302000.0),
    ("CONV_B", "dup-1", 1, 1764399303000.0),
    ("CONV_C", "solo", 1, 1764399304000.0),
]
_P_LINE = ("(APIServer pid=1) INFO 11-29 07:06:4{i} [logger.py:45] Received request {rid}: params: "
           "SamplingParams(n=1, temperature=0.0, max_tokens=1), lora_request: None.")


def _logs(tmp_path: Path) -> list[str]:
    stats = tmp_path / "client-stats.jsonl"
    stats.write_text("".join(json.dumps({
        "ttft_ms": 100.0 - i, "latency_ms": 400.0, "start_time_ms": start, "input_num_turns": turns,
        "input_num_tokens": 100 * turns, "output_num_tokens": 40, "conversation_id": conv, "request_id": rid,
    }) + "\n" for i, (conv, rid, turns, start) in enumerate(_STATS)))
    prefill = tmp_path / "prefill.log"
    prefill.write_text("".join(_P_LINE.format(i=i, rid=rid) + "\n" for i, rid in enumerate(("dup-1", "solo"))))
    return [str(stats), str(prefill)]


def test_each_statistic_is_one_turn_when_statistics_repeat_a_request_id(tmp_path: Path) -> None:
    files = _logs(tmp_path)
    convs = kvdiag.load_turns(files)
    turns = [(c.conversation_id, t.turn, t.request_id) for c in convs for t in c.turns]
    assert turns == [("CONV_A", 1, "dup-1"), ("CONV_A", 2, "dup-1"), ("CONV_B", 1, "dup-1"), ("CONV_C", 1, "solo")]
    cited = [e.source for c in convs for t in c.turns for e in t.evidence if "client-stats" in e.source]
    assert sorted(cited) == [f"{files[0]}:{n}" for n in range(1, 5)]  # each statistic cited by one turn, once
    # the one-conversation path and the turn table read the same turns
    for conv in convs:
        one = kvdiag.explain_conversation(files, conv.conversation_id)
        assert [t.__dict__ for t in one.turns] == [t.__dict__ for t in conv.turns]
    table = load_turn_arrow(files)
    assert table.num_rows == 4
    assert sorted(zip(table.column("conversation_id").to_pylist(), table.column("turn").to_pylist(),
                      strict=True)) == [("CONV_A", 1), ("CONV_A", 2), ("CONV_B", 1), ("CONV_C", 1)]


def test_the_repeated_id_holds_several_slots_and_each_turn_one_row(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdict_engine, "_JOINS_ONLY", ())  # (vl_slot is read below: the run keeps it)
    run = run_all(detect(_logs(tmp_path)))
    try:
        slots = run.con.execute("SELECT rid, count(*) FROM by_rid GROUP BY rid ORDER BY rid").fetchall()
        # (the case this file guards: were the id one slot, the joins below could not fan out)
        assert slots == [("dup-1", 3), ("solo", 1)]
        sids = [s for (s,) in run.con.execute("SELECT sid FROM decided").fetchall()]
        assert len(sids) == len(set(sids)) == 4
        # P's line naming the id is read for each of its slots, once each
        named = run.con.execute("SELECT sid, count(*) FROM vl_slot GROUP BY sid ORDER BY sid").fetchall()
        assert [n for _sid, n in named] == [1, 1, 1, 1]
    finally:
        run.con.close()
