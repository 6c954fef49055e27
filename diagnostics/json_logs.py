"""JSON inputs: kvdiag TurnEvents, vLLM multi-turn benchmark ``--stats-json-output`` records
(``RequestStats`` fields, docs/vllm-reference.md) and generic JSON lines carrying ``conversation_id`` + ``ttft_ms``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any, Final

from kvdiag.diagnostics.linestats import LineStats, decode_line
from kvdiag.schema.events import (
    EVENTS_BY_SOURCE,
    FLOAT_FIELDS,
    INT64_MAX,
    INT64_MIN,
    INT_FIELDS,
    NON_NEGATIVE,
    RELEASE_REASONS,
    SCHEMA_VERSION,
    STATUSES,
    STR_FIELDS,
    EventFormatError,
    TurnEvent,
    event_from_dict,
)
from kvdiag.schema.verdicts import TrimReason, Verdict

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
    start_ts: float | None = None  # start_time_ms / 1000 when it counts from the epoch, else None

    @property
    def source(self) -> str:
        """``file:line``."""
        return f"{self.path}:{self.lineno}"

    @property
    def epoch_start(self) -> bool:
        """True when ``start_time_ms`` counts from the epoch rather than from an arbitrary origin.

        vLLM's multi-turn benchmark takes it from ``time.perf_counter_ns()`` (time since boot on
        Linux); 2001-09-09 in epoch milliseconds is past any machine's uptime.
        """
        return self.start_time_ms is not None and self.start_time_ms >= EPOCH_MS_FLOOR


EPOCH_MS_FLOOR: Final = 1e12


def json_double(value: object) -> float | None:
    """A decoded JSON number as a double, as DuckDB reads it (an integer literal past a double's range is
    infinite); None for anything else (a bool is no number)."""
    if type(value) is float:  # the JSON decoder's own type: skip the slower checks
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _num(obj: dict[str, Any], key: str) -> float | None:
    return json_double(obj.get(key))


def _int(obj: dict[str, Any], key: str) -> int | None:
    """The number truncated, when it is finite and a 64-bit integer holds it (a count past that is no count;
    json.loads reads Infinity, NaN and 1e400 too)."""
    value = _num(obj, key)
    if value is None or not math.isfinite(value):
        return None
    whole = int(value)
    return whole if INT64_MIN <= whole <= INT64_MAX else None


# The schema's own field classes (schema/events.py), so the fast path below accepts exactly what
# event_from_dict accepts: 0 int, 1 float, 2 str, 3 attrs object.
_KIND: Final[dict[str, int]] = {
    **dict.fromkeys(INT_FIELDS, 0), **dict.fromkeys(FLOAT_FIELDS, 1), **dict.fromkeys(STR_FIELDS, 2), "attrs": 3}
_DEFAULTS: Final[dict[str, Any]] = {f.name: f.default for f in fields(TurnEvent) if f.default is not MISSING}
_OUTCOMES: Final = frozenset(v.value for v in Verdict)
_STATUSES: Final = frozenset(STATUSES)
_RELEASE_REASONS: Final = frozenset(RELEASE_REASONS)
_TRIM_REASONS: Final = frozenset(r.value for r in TrimReason)


def fast_event(obj: dict[str, Any]) -> TurnEvent | None:
    """The TurnEvent event_from_dict would return for a well-formed record, or None for anything else.

    Why: event_from_dict (validate, then a frozen dataclass's ``__init__`` over ~40 fields) was a
    third of ``explain --all``. This checks the same rules in one pass and fills the instance's
    ``__dict__`` directly; any doubt returns None so the caller falls back to event_from_dict, which
    raises with its precise message. tests/test_json_fast.py checks both agree.
    """
    if "ts" not in obj or "source" not in obj or "event" not in obj:
        return None
    clean: dict[str, Any] = {}
    for key, value in obj.items():
        kind = _KIND.get(key)
        if value is None and kind is not None:
            continue
        tp = type(value)
        if kind == 2:
            if tp is not str:
                return None
        elif kind == 0:
            if tp is not int or (value < 0 and key in NON_NEGATIVE) or not INT64_MIN <= value <= INT64_MAX:
                return None
        elif kind == 1:
            if tp is int:
                value = float(value)
            elif tp is not float or not math.isfinite(value):
                return None
            if value < 0 and key in NON_NEGATIVE:
                return None
        elif kind == 3:
            if tp is not dict:
                return None
        else:
            return None  # unknown field
        clean[key] = value
    if clean.get("v") != SCHEMA_VERSION or "ts" not in clean:
        return None
    source, event = clean.get("source"), clean.get("event")
    if source not in EVENTS_BY_SOURCE or event not in EVENTS_BY_SOURCE[source]:
        return None
    if ("outcome" in clean and clean["outcome"] not in _OUTCOMES) or ("turn" in clean and clean["turn"] < 1) \
            or ("status" in clean and clean["status"] not in _STATUSES) \
            or ("release_reason" in clean and clean["release_reason"] not in _RELEASE_REASONS) \
            or ("trim_reason" in clean and clean["trim_reason"] not in _TRIM_REASONS):
        return None
    ev: TurnEvent = object.__new__(TurnEvent)
    state = ev.__dict__
    state.update(_DEFAULTS)
    state["attrs"] = {}
    state.update(clean)
    return ev


def client_stat_from_dict(obj: Any, path: str, lineno: int, text: str) -> ClientStat | None:
    """A ClientStat from a decoded record, or None when it is not one (no conversation id)."""
    if not isinstance(obj, dict):
        return None
    conv = obj.get("conversation_id")
    # a string, or an integer a 64-bit word holds (signed or not); True is an int to Python, and no id
    if not (isinstance(conv, str) or (type(conv) is int and INT64_MIN <= conv < 1 << 64)):
        return None
    turn = _int(obj, "turn")
    rid = obj.get("request_id")
    start = _num(obj, "start_time_ms")
    return ClientStat(start_ts=start / 1000.0 if start is not None and start >= EPOCH_MS_FLOOR else None,
                      path=path, lineno=lineno, conversation_id=str(conv),
                      ttft_ms=_num(obj, "ttft_ms"), text=text[:500], start_time_ms=start,
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
        except (ValueError, RecursionError):  # (an integer past 4300 digits is a ValueError, not a decode error)
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
            event = fast_event(obj) or event_from_dict(obj)
            return EventRecord(path=path, lineno=lineno, event=event, text=text[:500])
        except EventFormatError as exc:
            stats.corrupt += 1
            stats.note(path, lineno, str(exc))
            return None
        except (TypeError, KeyError, OverflowError):  # a null required field, or an int too big for a float
            stats.corrupt += 1
            stats.note(path, lineno, "a required field (ts, source, event) is null, or a number is out of range")
            return None
    stat = client_stat_from_dict(obj, path, lineno, text)
    if stat is None:
        stats.other += 1
    return stat


def parse_json_document(data: bytes, path: str, stats: LineStats | None = None) -> Iterator[ClientStat]:
    """Yield client records from one (possibly pretty-printed) JSON array or object-of-lists document."""
    stats = stats if stats is not None else LineStats()
    text = data.decode("utf-8", errors="replace")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        stats.corrupt += 1
        stats.note(path, 1, "not a valid JSON document")
        return
    key: str | None = None
    items: list[Any] = []
    if isinstance(doc, list):
        items = doc
    elif isinstance(doc, dict):
        key, items = next(((k, v) for k, v in doc.items() if isinstance(v, list)), (None, []))
    lines = _element_lines(text, key, len(items))
    for index, item in enumerate(items, start=1):
        stats.lines += 1
        rec = client_stat_from_dict(item, path, lines[index - 1] if lines else index, json.dumps(item)[:500])
        if rec is None:
            stats.other += 1
            continue
        stats.records += 1
        yield rec


def parse_event_document(data: bytes, path: str, stats: LineStats) -> list[EventRecord | ClientStat] | None:
    """The records of an event file that is one JSON array over many lines, each at the line its element opens
    on; None (``stats`` untouched) when the file is no valid JSON array, which is then read as lines."""
    elements = array_elements(data)
    if elements is None:
        return None
    out: list[EventRecord | ClientStat] = []
    for lineno, item in elements:
        stats.lines += 1
        rec = _record(item, path, lineno, json.dumps(item), stats)
        if rec is not None:
            stats.records += 1
            out.append(rec)
    return out


def array_elements(data: bytes) -> list[tuple[int, Any]] | None:
    """The elements of a file that is one JSON array, each with the 1-based line it opens on (its index where that
    cannot be told); None when the file is no valid UTF-8 JSON array."""
    try:
        text = data.decode("utf-8")
        doc = json.loads(text)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    if not isinstance(doc, list):
        return None
    lines = _element_lines(text, None, len(doc)) or list(range(1, len(doc) + 1))
    return list(zip(lines, doc, strict=True))


def _element_lines(text: str, key: str | None, count: int) -> list[int]:
    """The 1-based line each element of the document's record list starts on (evidence ``file:line``).

    A pretty-printed ``--stats-json-output`` array puts a record on many lines; the element's index is
    not a line number. Returns ``[]`` when the list cannot be located (the caller falls back to the index).
    """
    decoder = json.JSONDecoder()
    if key is None:
        pos = text.find("[")
    else:
        m = re.search(re.escape(json.dumps(key)) + r"\s*:\s*\[", text)
        pos = m.end() - 1 if m else -1
    if pos < 0:
        return []
    out: list[int] = []
    pos += 1
    line, seen = 1, 0
    try:
        while len(out) < count:
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            line += text.count("\n", seen, pos)
            seen = pos
            out.append(line)
            _, pos = decoder.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return []
    return out
