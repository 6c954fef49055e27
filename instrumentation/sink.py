"""The connector's event writer: the scheduler thread only queues an event's fields.

``kvdiag.exporters.jsonl.EventSink`` takes finished ``TurnEvent`` objects. Inside a vLLM engine the
hooks run on the scheduler's thread, where building a 45-field frozen dataclass (≈ 5 µs) and, on the
writer thread, ``dataclasses.asdict`` for the JSON (≈ 30 µs, holding the GIL the scheduler needs)
are the largest costs of having events on. ``FieldsEventSink`` queues the plain fields dict instead
and, on its writer thread, builds the TurnEvent (so a wrong field still fails there, counted) and
its JSON line straight from the instance's attributes: the same line as ``TurnEvent.to_json()``.
``emit_call`` goes further: the fields themselves are built on the writer thread.

Usage::

    sink = FieldsEventSink("/var/log/kvdiag/decode-events.jsonl", max_queue=10_000)
    sink.emit_fields({"ts": now_ts(), "source": "decode", "event": "kv_released", ...})
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import IO, Any

from kvdiag.exporters.jsonl import EventSink
from kvdiag.schema.events import TurnEvent

_logger = logging.getLogger(__name__)


def event_json(event: TurnEvent) -> str:
    """``event.to_json()`` without ``asdict``'s deep copy: ``v`` first, ``None`` and empty attrs omitted."""
    out: dict[str, Any] = {"v": event.v}
    for key, value in vars(event).items():
        if key == "v" or value is None or (key == "attrs" and not value):
            continue
        out[key] = value
    return json.dumps(out, separators=(",", ":"), sort_keys=False)


class FieldsEventSink(EventSink):
    """An EventSink whose producers queue field dicts; events are built and encoded on its thread."""

    def emit_fields(self, fields: dict[str, Any]) -> bool:
        """Queue one event's fields (never blocks or raises; False and counted if dropped)."""
        return self.emit(fields)  # type: ignore[arg-type]  # the queue takes any item; _write builds it

    def emit_call(self, build: Callable[..., dict[str, Any]], *args: Any) -> bool:
        """Queue ``build(*args)``, run on the writer thread to produce the fields: the producer pays
        for a tuple and a queue put only. ``args`` must not change after this call."""
        return self.emit((build, args))  # type: ignore[arg-type]

    def _write(self, fh: IO[str] | None, item: object) -> None:
        if not isinstance(item, dict | tuple):
            super()._write(fh, item)
            return
        if fh is None:
            self._count_error()
            return
        try:
            if isinstance(item, tuple):
                build, args = item
                item = build(*args)
            line = event_json(TurnEvent(**item))  # type: ignore[arg-type]
        except Exception as exc:  # a bad builder or field: counted, never raised into the writer loop
            self._count_error()
            _logger.warning("kvdiag event not written (%s): %s", self.path, exc)
            return
        try:
            fh.write(line + "\n")
            if self._queue.unfinished_tasks <= 1:
                fh.flush()
            self.written += 1
        except OSError as exc:
            self._count_error()
            _logger.warning("event write to %s failed: %s", self.path, exc)
