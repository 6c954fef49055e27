"""JSON inputs: kvdiag TurnEvents, vLLM multi-turn benchmark ``--stats-json-output`` records
(``RequestStats`` fields, vllm.md §7) and generic JSON lines carrying ``conversation_id`` + ``ttft_ms``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from kvdiag.diagnostics.linestats import LineStats, decode_line
from kvdiag.schema.events import EventFormatError, TurnEvent, event_from_dict

REQUEST_STATS_FIELDS: Final = (
    "ttft_ms", "tpot_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
    "output_num_tokens", "output_num_chunks", "output_num_first_chunk_tokens", "approx_cached_percent",
    "conversation_id", "client_id",
)


@dataclass(slots=True)
class EventRecord:
    """One TurnEvent and where it was read."""

    path: str
    lineno: int
    event: TurnEvent
    text: str

    @property
    def source(self) -> str:
        """``file:line``."""
        return f"{self.path}:{self.lineno}"


@dataclass(slots=True)
class ClientStat:
    """One client-side request record (benchmark RequestStats or a generic JSON line)."""

    path: str
    lineno: int
    conversation_id: str
    ttft_ms: float | None
    text: str
    start_time_ms: float | None = None
    latency_ms: float | None = None
    input_num_turns: int | None = None
    input_num_tokens: int | None = None
    output_num_tokens: int | None = None
    turn: int | None = None
    request_id: str | None = None

    @property
    def source(self) -> str:
        """``file:line``."""
        return f"{self.path}:{self.lineno}"


def _num(obj: dict[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(obj: dict[str, Any], key: str) -> int | None:
    value = _num(obj, key)
    return int(value) if value is not None else None


def client_stat_from_dict(obj: Any, path: str, lineno: int, text: str) -> ClientStat | None:
    """A ClientStat from a decoded record, or None when it is not one (no conversation id)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("conversation_id"), str | int):
        return None
    turn = _int(obj, "turn")
    rid = obj.get("request_id")
    return ClientStat(path=path, lineno=lineno, conversation_id=str(obj["conversation_id"]),
                      ttft_ms=_num(obj, "ttft_ms"), text=text[:500], start_time_ms=_num(obj, "start_time_ms"),
                      latency_ms=_num(obj, "latency_ms"), input_num_turns=_int(obj, "input_num_turns"),
                      input_num_tokens=_int(obj, "input_num_tokens"),
                      output_num_tokens=_int(obj, "output_num_tokens"),
                      turn=turn if turn is not None and turn >= 1 else None,
                      request_id=rid if isinstance(rid, str) else None)


def parse_json_lines(lines: Iterable[bytes | str], path: str = "<stdin>",
                     stats: LineStats | None = None) -> Iterator[EventRecord | ClientStat]:
    """Yield events and client records from JSON lines (see parse_json_numbered)."""
    return parse_json_numbered(enumerate(lines, start=1), path, stats)


def parse_json_numbered(numbered: Iterable[tuple[int, bytes | str]], path: str = "<stdin>",
                        stats: LineStats | None = None) -> Iterator[EventRecord | ClientStat]:
    """Yield events (objects with ``v``/``source``/``event``) and client records from JSON lines.

    A line that is not JSON, or an event that breaks the schema, is counted as corrupt and skipped.
    A JSON array line (a whole ``--stats-json-output`` document on one line) yields each element.
    """
    stats = stats if stats is not None else LineStats()
    for lineno, raw in numbered:
        text, ok = decode_line(raw)
        text = text.strip()
        if not text:
            continue
        stats.lines += 1
        try:
            obj = json.loads(text) if ok else None
        except (json.JSONDecodeError, RecursionError):
            obj = None
        if obj is None:
            stats.corrupt += 1
            stats.note(path, lineno, "not a JSON object")
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            rec = _record(item, path, lineno, text, stats)
            if rec is not None:
                stats.records += 1
                yield rec


def _record(obj: Any, path: str, lineno: int, text: str, stats: LineStats) -> EventRecord | ClientStat | None:
    if isinstance(obj, dict) and "event" in obj and "source" in obj and "v" in obj:
        try:
            return EventRecord(path=path, lineno=lineno, event=event_from_dict(obj), text=text[:500])
        except EventFormatError as exc:
            stats.corrupt += 1
            stats.note(path, lineno, str(exc))
            return None
    stat = client_stat_from_dict(obj, path, lineno, text)
    if stat is None:
        stats.other += 1
    return stat


def parse_json_document(data: bytes, path: str, stats: LineStats | None = None) -> Iterator[ClientStat]:
    """Yield client records from one (possibly pretty-printed) JSON array or object-of-lists document."""
    stats = stats if stats is not None else LineStats()
    try:
        doc = json.loads(data.decode("utf-8", errors="replace"))
    except (json.JSONDecodeError, RecursionError):
        stats.corrupt += 1
        stats.note(path, 1, "not a valid JSON document")
        return
    items: list[Any] = doc if isinstance(doc, list) else next(
        (v for v in doc.values() if isinstance(v, list)), []) if isinstance(doc, dict) else []
    for index, item in enumerate(items, start=1):
        stats.lines += 1
        rec = client_stat_from_dict(item, path, index, json.dumps(item)[:500])
        if rec is None:
            stats.other += 1
            continue
        stats.records += 1
        yield rec
