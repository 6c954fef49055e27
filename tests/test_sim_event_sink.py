"""The bounded, non-blocking JSONL event sink (exporters/jsonl.py) the engines write through."""

from __future__ import annotations

from pathlib import Path

from kvdiag.exporters.jsonl import EventSink
from kvdiag.schema.events import TurnEvent, read_events


def _ev(i: int) -> TurnEvent:
    return TurnEvent(ts=1.0 + i, source="decode", event="kv_released", engine_request_id=f"r{i}",
                     release_reason="read")


def test_events_round_trip_through_the_sink(tmp_path: Path) -> None:
    sink = EventSink(tmp_path / "e.jsonl")
    for i in range(50):
        assert sink.emit(_ev(i))
    assert sink.flush()
    assert [e.engine_request_id for e in read_events(tmp_path / "e.jsonl")] == [f"r{i}" for i in range(50)]
    sink.close()
    assert sink.written == 50 and sink.dropped == 0


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    errors: list[int] = []
    sink = EventSink(tmp_path / "e.jsonl", max_queue=1, on_error=lambda: errors.append(1))
    results = [sink.emit(_ev(i)) for i in range(2000)]
    sink.close()
    assert not all(results) and sink.dropped == results.count(False) == len(errors)
    assert sink.written + sink.dropped == 2000


def test_unwritable_path_is_counted_not_raised(tmp_path: Path) -> None:
    sink = EventSink(tmp_path / "missing-dir" / "e.jsonl")
    assert sink.emit(_ev(1))
    sink.close()
    assert sink.errors == 1 and sink.written == 0
    assert not sink.emit(_ev(2)) and sink.dropped == 1
