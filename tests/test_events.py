"""The event schema: round trip, and clear errors for malformed records."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvdiag.schema.events import (
    EventFormatError,
    PrefillReport,
    ReadStats,
    TurnEvent,
    parse_event,
    read_events,
)
from kvdiag.schema.verdicts import Verdict


def _ev(**kw: object) -> TurnEvent:
    base: dict[str, object] = {"ts": 1764400000.123, "source": "router", "event": "router_turn"}
    base.update(kw)
    return TurnEvent(**base)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field() -> None:
    ev = _ev(conversation_id="c1", turn=2, request_id="r", outcome="remote_hit", transfer_bytes=983040,
             transfer_ms=4.2, attrs={"k": 1})
    line = ev.to_json()
    assert json.loads(line)["v"] == 1
    assert parse_event(line) == ev
    assert ev.verdict is Verdict.REMOTE_HIT


def test_none_fields_are_omitted() -> None:
    assert set(json.loads(_ev().to_json())) == {"v", "ts", "source", "event"}


@pytest.mark.parametrize(
    ("record", "field", "fragment"),
    [
        ({"ts": 1.0, "source": "router", "event": "router_turn"}, "v", "missing"),
        ({"v": 2, "ts": 1.0, "source": "router", "event": "router_turn"}, "v", "version"),
        ({"v": 1, "ts": 1.0, "source": "gpu", "event": "x"}, "source", "unknown source"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "prefill_request"}, "event", "unknown event"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "outcome": "hit"}, "outcome", "verdict"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "turn": 0}, "turn", "from 1"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "turn": "2"}, "turn", "integer"),
        ({"v": 1, "ts": "now", "source": "router", "event": "router_turn"}, "ts", "number"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "transfer_bytes": -1},
         "transfer_bytes", "negative"),
        ({"v": 1, "ts": 1.0, "source": "router", "event": "router_turn", "bogus": 1}, "bogus", "attrs"),
    ],
)
def test_malformed_records_are_rejected_with_the_field_named(record: dict[str, object], field: str,
                                                              fragment: str) -> None:
    with pytest.raises(EventFormatError) as err:
        parse_event(json.dumps(record), path="events.jsonl", lineno=7)
    assert err.value.field_name == field
    assert "events.jsonl:7" in str(err.value)
    assert fragment in str(err.value)


def test_invalid_json_names_the_line() -> None:
    with pytest.raises(EventFormatError, match=r"events\.jsonl:3: not valid JSON"):
        parse_event("{not json", path="events.jsonl", lineno=3)


def test_lenient_read_counts_and_skips_corrupt_lines(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl.gz"
    good = _ev(turn=1).to_json()
    with gzip.open(path, "wt") as fh:
        fh.write(good + "\n\x00garbage\n" + good + "\n\n")
    stats = ReadStats()
    events = list(read_events(path, strict=False, stats=stats))
    assert len(events) == 2 and stats.records == 2 and stats.skipped == 1
    assert "e.jsonl.gz:2" in stats.errors[0]
    with pytest.raises(EventFormatError):
        list(read_events(path))


def test_prefill_report_validates() -> None:
    rep = PrefillReport(engine_request_id="chatcmpl-a-12345678", prompt_tokens=100, local_hit_tokens=0,
                        remote_offered_tokens=139, remote_read_tokens=96, computed_tokens=4,
                        outcome="remote_hit", transfer_bytes=10, transfer_ms=1.5)
    assert PrefillReport.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep
    bad = rep.to_dict() | {"outcome": "nope"}
    with pytest.raises(EventFormatError, match="outcome"):
        PrefillReport.from_dict(bad)
