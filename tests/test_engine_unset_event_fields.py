"""A fact that only event fields no event sets could give is left NULL, unbound: the same turns as binding it.

The engine learns which fields the events set while it parses them; ``ev_facts`` then writes NULL for the facts
whose value is such a field or whose condition needs one. Checked against the engine with every fact bound, on
event logs with random fields left out, on the benchmark generator's sparse events, and with a negative control:
treating a field the events do set as unset changes the turns.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
from gen_logs_support import load_gen_logs

import kvdiag
from kvdiag.diagnostics import verdict_engine
from kvdiag.diagnostics.detect import detect
from kvdiag.diagnostics.engine_facts import _never_set, facts_sql
from kvdiag.diagnostics.event_table_columns import EVENT_TABLE_COLUMNS
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations
from kvdiag.diagnostics.turn_loader import run_all

_READ_ODD_JSON = verdict_engine.jr.read_odd_json

# fields the synthetic events may lose (the keys every event needs stay)
_DROPPABLE = ("completion_tokens", "computed_tokens", "duration_ms", "gap_s", "handle_tokens", "local_hit_tokens",
              "model", "prefill_ms", "reason", "remote_offered_tokens", "remote_read_tokens", "reuse_limit_tokens",
              "status", "transfer_bytes", "transfer_ms", "ttft_ms", "ttl_s", "wrong_kv_tokens", "prompt_tokens",
              "outcome")


def test_a_fact_is_never_set_when_its_value_or_a_conjunct_needs_an_unset_field() -> None:
    unset = {"status", "ttft_ms"}
    assert _never_set("ttft_ms", "grp = 0", unset)
    assert _never_set("((f::BIGINT << 40) + n)", "grp = 0 AND status = 'ok'", unset)
    assert _never_set("o", "grp < 3 AND ttft_ms IS NOT NULL", unset)
    assert _never_set("o", "grp IN (0, 1) AND status IN ('error', 'timeout')", unset)
    assert _never_set("o", "grp = 2 AND status <> ''", unset)
    # a condition an unset field can meet, or one not looked into, keeps the fact
    assert not _never_set("o", "grp = 0 AND status IS NULL", unset)
    assert not _never_set("o", "grp = 0 AND (status = 'ok' OR outcome IS NOT NULL)", unset)
    assert not _never_set("o", "grp = 0 AND outcome IS NOT NULL", unset)
    assert not _never_set("'status=' || status", "grp = 0", unset)


def test_unknown_fields_bind_every_fact() -> None:
    assert facts_sql(None, None) == facts_sql(None)
    narrowed = " ".join(facts_sql(None, ["ts"]))
    assert "arg_min(ttft_ms" not in narrowed and "arg_min(ttft_ms" in " ".join(facts_sql(None, None))


def _synthetic(out: Path, seed: int) -> list[str]:
    rng = random.Random(seed)
    convs = synthetic_conversations(SynthParams(conversations=40, seed=seed, missing_metadata_share=0.2,
                                                trim_share=0.3))
    dropped = set(rng.sample(_DROPPABLE, rng.randint(3, 12)))
    out.mkdir()
    paths = []
    for name, lines in (("client.jsonl", client_events(convs)), ("router-events.jsonl", router_events(convs))):
        events = [json.loads(line) for line in lines]
        for ev in events:
            for key in dropped & ev.keys():
                del ev[key]
        (out / name).write_text("".join(json.dumps(ev) + "\n" for ev in events))
        paths.append(str(out / name))
    return paths


def _generated(out: Path, seed: int) -> list[str]:
    load_gen_logs().generate(out, 150_000, seed=seed, noise_per_turn=1)
    return sorted(str(p) for p in out.iterdir() if p.is_file())


def _turns(files: list[str]) -> list[dict[str, Any]]:
    convs = kvdiag.load_turns(files)
    convs += [kvdiag.explain_conversation(files, c.conversation_id) for c in convs[:3]]  # the few-rows runs
    return [c.to_json_dict() for c in convs]


def _with_fields(monkeypatch: pytest.MonkeyPatch, given: Callable[[Collection[str] | None], Collection[str] | None]
                 ) -> None:
    monkeypatch.setattr(verdict_engine, "facts_sql", lambda kinds, cols=None: facts_sql(kinds, given(cols)))


@pytest.mark.parametrize(("make", "seed"), [(_synthetic, 1), (_synthetic, 2), (_synthetic, 3), (_generated, 4)],
                         ids=["synthetic-1", "synthetic-2", "synthetic-3", "generated"])
def test_leaving_unset_fields_unbound_gives_the_same_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           make: Callable[[Path, int], list[str]], seed: int) -> None:
    files = make(tmp_path / "logs", seed)
    seen: list[frozenset[str]] = []
    _with_fields(monkeypatch, lambda cols: seen.append(frozenset(cols or ())) or cols)
    narrowed = _turns(files)
    assert seen and all("ts" in cols for cols in seen)
    _with_fields(monkeypatch, lambda cols: None)
    assert _turns(files) == narrowed
    # negative control: a field the events set, taken for unset, changes the turns
    _with_fields(monkeypatch, lambda cols: None if cols is None else set(cols) - {"prompt_tokens", "outcome"})
    assert _turns(files) != narrowed


def test_unbound_facts_keep_the_types_bound_ones_have(tmp_path: Path) -> None:
    run = run_all(detect(_synthetic(tmp_path / "logs", 5)), windows=False)
    try:
        assert run.event_columns is not None and set(_DROPPABLE) - run.event_columns, "some fields are unset"
        got = {c: t for c, t, *_ in run.con.execute("DESCRIBE ev_facts").fetchall()}
    finally:
        run.con.close()
    want = dict(EVENT_TABLE_COLUMNS["ev_facts"])
    assert len(got) > 20 and got == {c: want[c] for c in got}


def test_a_field_only_lines_python_reads_set_is_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every event loses ttft_ms but one client event, written as a JSON array (json_logs reads such a line, not
    # the SQL): its field comes to the engine after the SQL's own reading
    files = _synthetic(tmp_path / "logs", 6)
    client = Path(files[0])
    lines = client.read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for ev in events:
        ev.pop("ttft_ms", None)
    events[-1]["ttft_ms"] = 123.0
    client.write_text("".join(json.dumps(ev) + "\n" for ev in events[:-1]) + json.dumps([events[-1]]) + "\n")
    run = run_all(detect(files), windows=False)
    try:
        assert run.event_columns is not None and "ttft_ms" in run.event_columns
    finally:
        run.con.close()
    narrowed = _turns(files)
    assert any(t["ttft_ms"] == 123.0 for c in narrowed for t in c["turns"])
    _with_fields(monkeypatch, lambda cols: None)
    assert _turns(files) == narrowed
    # negative control: the fields the JSON array set, not noted, lose its ttft_ms
    monkeypatch.undo()
    monkeypatch.setattr(verdict_engine.jr, "read_odd_json", lambda *a: (_READ_ODD_JSON(*a), [])[1])
    assert _turns(files) != narrowed
