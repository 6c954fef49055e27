"""The fast TurnEvent path (json_logs.fast_event) accepts exactly what schema.events.event_from_dict accepts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiag.diagnostics.json_logs import fast_event
from kvdiag.schema.events import EventFormatError, TurnEvent, event_from_dict

VALID: dict[str, Any] = {
    "v": 1, "ts": 1700000000.5, "source": "router", "event": "router_turn", "conversation_id": "c1", "turn": 2,
    "request_id": "r-2", "prompt_tokens": 4096, "transfer_ms": 3, "outcome": "remote_hit", "status": "ok",
    "attrs": {"k": 1},
}
# Values that break one rule or another (types, signs, enumerations, infinities, booleans as ints).
ODD_VALUES = st.sampled_from([None, True, False, -1, 0, 1, 2.5, -0.5, float("inf"), float("nan"), "", "x", "ok",
                              "remote_hit", "router", "client_turn", [], {}, {"a": 1}, 10**20])
KEYS = st.sampled_from([*VALID, "ttl_s", "expiry_ts", "release_reason", "http_status", "gap_s", "bogus", "lookup"])


def _slow(obj: dict[str, Any]) -> TurnEvent | None:
    try:
        return event_from_dict(obj)
    except (EventFormatError, TypeError, KeyError):  # null required fields trip the schema reader
        return None


def test_valid_event_takes_the_fast_path_and_equals_the_schema_reader() -> None:
    ev = fast_event(dict(VALID))
    assert ev is not None
    assert ev == event_from_dict(dict(VALID))
    assert ev.transfer_ms == 3.0 and isinstance(ev.transfer_ms, float)
    assert ev.remote_read_tokens is None and ev.attrs == {"k": 1}
    bare = fast_event({"v": 1, "ts": 1.0, "source": "client", "event": "client_turn"})
    assert bare is not None and bare.attrs == {} and bare == event_from_dict(
        {"v": 1, "ts": 1.0, "source": "client", "event": "client_turn"})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(KEYS, ODD_VALUES, max_size=4), st.lists(KEYS, max_size=2))
def test_fast_path_never_accepts_what_the_schema_rejects(changes: dict[str, Any], dropped: list[str]) -> None:
    obj = {**VALID, **changes}
    for key in dropped:
        obj.pop(key, None)
    fast = fast_event(dict(obj))
    slow = _slow(dict(obj))
    if fast is not None:
        assert slow is not None and fast == slow
    # The fast path may only decline well-formed records it cannot vouch for; none of these exist today.
    if slow is not None:
        assert fast == slow


def test_null_required_field_is_a_counted_corrupt_line_not_a_crash() -> None:
    import json

    from kvdiag.diagnostics.json_logs import parse_json_lines
    from kvdiag.diagnostics.linestats import LineStats

    stats = LineStats()
    lines = [json.dumps({**VALID, "source": None}), json.dumps({**VALID, "ts": None}), json.dumps(VALID)]
    recs = list(parse_json_lines(lines, "ev.jsonl", stats))
    assert len(recs) == 1 and stats.corrupt == 2
    assert stats.notes[0].startswith("ev.jsonl:1: ")
