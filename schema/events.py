"""The per-turn event record (JSON lines, ``"v": 1``): the single source of truth.

Every emitter (sim engines, router, connector, workload client) writes ``TurnEvent`` records and
every reader parses them with :func:`parse_event` / :func:`read_events`. docs/events.md documents
the fields. Pure Python, no heavy imports: this module is imported inside vLLM engines.

Usage::

    ev = TurnEvent(ts=now_ts(), source="router", event="router_turn", conversation_id="c1", turn=2,
                   outcome="remote_hit")
    line = ev.to_json()
    assert parse_event(line) == ev
"""

from __future__ import annotations

import gzip
import json
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Final

from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.verdicts import TrimReason, Verdict

SCHEMA_VERSION: Final = 1

SOURCES: Final = ("client", "router", "prefill", "decode")

# Event names per source. A reader rejects a name that does not belong to its source.
EVENTS_BY_SOURCE: Final[dict[str, tuple[str, ...]]] = {
    "client": ("client_turn",),
    "router": ("router_turn",),
    "prefill": ("prefill_request", "engine_start"),
    "decode": ("decode_request", "kv_retained", "kv_released", "engine_start"),
}

STATUSES: Final = ("ok", "error", "aborted", "disconnected", "timeout", "hung")

# Why D gave up blocks it was holding for the next turn.
RELEASE_REASONS: Final = ("read", "expired", "evicted", "restart", "notify_only")


class EventFormatError(KVDiagError, ValueError):
    """A record does not follow the event schema; the message names the place and the fix."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field_name: str | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        elif line is not None:
            where = f"line {line}: "
        if field_name is not None:
            where += f"field {field_name!r}: "
        super().__init__(where + message)
        self.path = path
        self.line = line
        self.field_name = field_name


def now_ts() -> float:
    """Epoch seconds with millisecond precision, as every event's ``ts``."""
    return round(time.time(), 3)


@dataclass(frozen=True)
class TurnEvent:
    """One per-turn (or per-request) record; ``None`` fields are omitted from the JSON."""

    ts: float
    source: str
    event: str
    v: int = SCHEMA_VERSION
    conversation_id: str | None = None
    turn: int | None = None
    request_id: str | None = None
    engine_request_id: str | None = None
    engine_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    # token accounting
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    local_hit_tokens: int | None = None
    remote_offered_tokens: int | None = None
    remote_read_tokens: int | None = None
    computed_tokens: int | None = None
    # D->P transfer as reported by the reader (P)
    transfer_bytes: int | None = None
    transfer_ms: float | None = None
    # partial reuse: how much of D's handle the router let P read, and why not all of it
    handle_tokens: int | None = None
    reuse_limit_tokens: int | None = None
    trimmed_tokens: int | None = None
    trim_reason: str | None = None
    wrong_kv_tokens: int | None = None
    mismatch_tokens: int | None = None
    # durations
    ttft_ms: float | None = None
    duration_ms: float | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    router_overhead_ms: float | None = None
    # router view
    lookup: str | None = None
    entry_age_s: float | None = None
    gap_s: float | None = None
    # handle / retention
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    retained_blocks: int | None = None
    expiry_ts: float | None = None
    ttl_s: float | None = None
    release_reason: str | None = None
    # outcome
    outcome: str | None = None
    reason: str | None = None
    failure_type: str | None = None
    status: str | None = None
    http_status: int | None = None
    trace_id: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON object, without ``None`` fields and with ``v`` first."""
        out: dict[str, Any] = {"v": self.v}
        for key, value in asdict(self).items():
            if key == "v" or value is None or (key == "attrs" and not value):
                continue
            out[key] = value
        return out

    def to_json(self) -> str:
        """Return one JSON line (no trailing newline)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=False)

    @property
    def verdict(self) -> Verdict | None:
        """The outcome as a Verdict, if set."""
        return Verdict(self.outcome) if self.outcome is not None else None


_FIELD_TYPES: Final[dict[str, tuple[type, ...]]] = {}
INT_FIELDS: Final = frozenset({
    "v", "turn", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
    "remote_read_tokens", "computed_tokens", "transfer_bytes", "retained_blocks", "http_status",
    "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "wrong_kv_tokens", "mismatch_tokens",
})
FLOAT_FIELDS: Final = frozenset({
    "ts", "transfer_ms", "ttft_ms", "duration_ms", "prefill_ms", "decode_ms", "router_overhead_ms",
    "entry_age_s", "gap_s", "expiry_ts", "ttl_s",
})
STR_FIELDS: Final = frozenset({
    "source", "event", "conversation_id", "request_id", "engine_request_id", "engine_id", "tenant",
    "model", "lookup", "remote_engine_id", "remote_request_id", "release_reason", "outcome", "reason",
    "failure_type", "status", "trace_id", "trim_reason",
})
FIELD_NAMES: Final = tuple(f.name for f in fields(TurnEvent))
_REQUIRED: Final = ("v", "ts", "source", "event")
NON_NEGATIVE: Final = INT_FIELDS | (FLOAT_FIELDS - {"ts", "expiry_ts"})
# an integer field holds a signed 64-bit word: what Parquet, Arrow and DuckDB store
INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1


def _check_value(key: str, value: Any) -> Any:
    if key in INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise EventFormatError(f"expected an integer, got {value!r}", field_name=key)
        if not INT64_MIN <= value <= INT64_MAX:
            raise EventFormatError(f"integer out of range (a signed 64-bit word holds it), got {value!r}",
                                   field_name=key)
    elif key in FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise EventFormatError(f"expected a finite number, got {value!r}", field_name=key)
        value = float(value)
    elif key in STR_FIELDS:
        if not isinstance(value, str):
            raise EventFormatError(f"expected a string, got {value!r}", field_name=key)
    elif key == "attrs":
        if not isinstance(value, dict):
            raise EventFormatError(f"expected an object, got {value!r}", field_name=key)
    if key in NON_NEGATIVE and value < 0:
        raise EventFormatError(f"must not be negative, got {value!r}", field_name=key)
    return value


def event_from_dict(obj: Any) -> TurnEvent:
    """Validate one decoded JSON object and return the TurnEvent; raise EventFormatError."""
    if not isinstance(obj, dict):
        raise EventFormatError(f"expected a JSON object, got {type(obj).__name__}")
    for key in _REQUIRED:
        if key not in obj:
            raise EventFormatError("required field is missing", field_name=key)
    if obj["v"] != SCHEMA_VERSION:
        raise EventFormatError(
            f"unsupported schema version {obj['v']!r}; this kvdiag reads version {SCHEMA_VERSION}",
            field_name="v")
    unknown = sorted(set(obj) - set(FIELD_NAMES))
    if unknown:
        raise EventFormatError(
            f"unknown field(s) {', '.join(unknown)}; put extra data under 'attrs'", field_name=unknown[0])
    clean = {key: _check_value(key, value) for key, value in obj.items() if value is not None}
    source = clean["source"]
    if source not in SOURCES:
        raise EventFormatError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}",
                               field_name="source")
    if clean["event"] not in EVENTS_BY_SOURCE[source]:
        raise EventFormatError(
            f"unknown event {clean['event']!r} for source {source!r}; expected one of "
            f"{', '.join(EVENTS_BY_SOURCE[source])}", field_name="event")
    if "outcome" in clean:
        try:
            Verdict(clean["outcome"])
        except ValueError:
            raise EventFormatError(
                f"unknown outcome {clean['outcome']!r}; expected a verdict name "
                f"({', '.join(v.value for v in Verdict)})", field_name="outcome") from None
    if "turn" in clean and clean["turn"] < 1:
        raise EventFormatError("turns are numbered from 1", field_name="turn")
    if "status" in clean and clean["status"] not in STATUSES:
        raise EventFormatError(f"unknown status {clean['status']!r}; expected one of {', '.join(STATUSES)}",
                               field_name="status")
    if "trim_reason" in clean:
        try:
            TrimReason(clean["trim_reason"])
        except ValueError:
            raise EventFormatError(
                f"unknown trim_reason {clean['trim_reason']!r}; expected one of "
                f"{', '.join(r.value for r in TrimReason)}", field_name="trim_reason") from None
    if "release_reason" in clean and clean["release_reason"] not in RELEASE_REASONS:
        raise EventFormatError(
            f"unknown release_reason {clean['release_reason']!r}; expected one of "
            f"{', '.join(RELEASE_REASONS)}", field_name="release_reason")
    return TurnEvent(**clean)


def parse_event(line: str | bytes, *, path: str | None = None, lineno: int | None = None) -> TurnEvent:
    """Parse one JSON line into a TurnEvent; raise EventFormatError naming path/line/field."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:  # (not JSON or UTF-8; an integer past 4300 digits; deep nesting)
        raise EventFormatError(f"not valid JSON ({exc}); each line must be one JSON object",
                               path=path, line=lineno) from None
    try:
        return event_from_dict(obj)
    except EventFormatError as exc:
        raise EventFormatError(str(exc).split(": ", 1)[-1] if exc.field_name else str(exc),
                               path=path, line=lineno, field_name=exc.field_name) from None


def _open_text(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open("r", encoding="utf-8", errors="replace")


@dataclass
class ReadStats:
    """Counts from a lenient read: good records and skipped corrupt lines (first errors kept)."""

    records: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)


def read_events(source: str | Path | Iterable[str], *, strict: bool = True,
                stats: ReadStats | None = None) -> Iterator[TurnEvent]:
    """Yield events from a JSON-lines file (``.gz`` too) or an iterable of lines.

    strict: raise EventFormatError on the first bad record; otherwise count it in ``stats``
    and go on with the rest.
    """
    if isinstance(source, str | Path):
        path = Path(source)
        with _open_text(path) as fh:
            yield from _read_lines(fh, str(path), strict, stats)
    else:
        yield from _read_lines(source, None, strict, stats)


def _read_lines(lines: Iterable[str], path: str | None, strict: bool,
                stats: ReadStats | None) -> Iterator[TurnEvent]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = parse_event(line, path=path, lineno=lineno)
        except EventFormatError as exc:
            if strict:
                raise
            if stats is not None:
                stats.skipped += 1
                if len(stats.errors) < 20:
                    stats.errors.append(str(exc))
            continue
        if stats is not None:
            stats.records += 1
        yield event


# ---------------------------------------------------------------------------------------------
# The per-request report P returns under ``kv_transfer_params["kvdiag"]`` (sim and connector).

REPORT_KEY: Final = "kvdiag"
REPORT_FIELDS: Final = (
    "v", "engine_request_id", "engine_id", "prompt_tokens", "local_hit_tokens", "remote_offered_tokens",
    "remote_read_tokens", "computed_tokens", "transfer_bytes", "transfer_ms", "outcome", "reason",
    "failure_type", "remote_engine_id", "remote_request_id", "wrong_kv_tokens", "mismatch_tokens",
)


@dataclass(frozen=True)
class PrefillReport:
    """What P tells the router about one request: how its prompt was covered and any D->P read."""

    engine_request_id: str
    prompt_tokens: int
    local_hit_tokens: int
    remote_offered_tokens: int
    remote_read_tokens: int
    computed_tokens: int
    outcome: str
    engine_id: str | None = None
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    reason: str | None = None
    failure_type: str | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    # tokens P loaded whose KV was computed for other token ids (the sim's oracle; must stay 0)
    wrong_kv_tokens: int | None = None
    # tokens D offered that P's block-hash check found not matching its prompt, so not read
    mismatch_tokens: int | None = None
    v: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON object placed under kv_transfer_params['kvdiag']."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, obj: Any) -> PrefillReport:
        """Validate a report received from P; raise EventFormatError on a bad one."""
        if not isinstance(obj, dict):
            raise EventFormatError("kvdiag report must be a JSON object", field_name=REPORT_KEY)
        unknown = sorted(set(obj) - set(REPORT_FIELDS))
        if unknown:
            raise EventFormatError(f"unknown report field(s) {', '.join(unknown)}", field_name=unknown[0])
        if obj.get("v") != SCHEMA_VERSION:
            raise EventFormatError(f"unsupported report version {obj.get('v')!r}", field_name="v")
        for key in ("engine_request_id", "prompt_tokens", "local_hit_tokens", "remote_offered_tokens",
                    "remote_read_tokens", "computed_tokens", "outcome"):
            if key not in obj:
                raise EventFormatError("required report field is missing", field_name=key)
        clean = {k: _check_value(k, v) for k, v in obj.items() if v is not None}
        try:
            Verdict(clean["outcome"])
        except ValueError:
            raise EventFormatError(f"unknown outcome {clean['outcome']!r}", field_name="outcome") from None
        return cls(**clean)
