"""A bounded, non-blocking JSON-lines sink for TurnEvents.

``emit`` never blocks and never raises: events go through a bounded queue to a writer thread; when
the queue is full the event is dropped and counted. Write errors are caught, counted and logged,
so telemetry can never crash or stall the host (engine, router, connector).

Usage::

    sink = EventSink("prefill-events.jsonl")
    sink.emit(TurnEvent(ts=now_ts(), source="prefill", event="engine_start", engine_id="e1"))
    sink.close()   # flushes what is queued
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from kvdiag.schema.events import TurnEvent

_logger = logging.getLogger(__name__)

_STOP = object()


class EventSink:
    """Appends events to ``path`` from a background thread; ``max_queue`` bounds memory."""

    def __init__(self, path: str | Path, max_queue: int = 10_000,
                 on_error: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self.dropped = 0
        self.errors = 0
        self.written = 0
        self._on_error = on_error
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvdiag-event-sink", daemon=True)
        self._thread.start()

    def emit(self, event: TurnEvent) -> bool:
        """Queue ``event``; return False (and count it) if it was dropped."""
        if self._closed:
            self._count_error(dropped=True)
            return False
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self._count_error(dropped=True)
            return False

    def _count_error(self, dropped: bool = False) -> None:
        if dropped:
            self.dropped += 1
        else:
            self.errors += 1
        if self._on_error is not None:
            try:
                self._on_error()
            except Exception:  # a metrics callback must never break the sink
                _logger.debug("event sink error callback failed", exc_info=True)

    def _run(self) -> None:
        try:
            fh = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            _logger.error("cannot open event file %s: %s", self.path, exc)
            fh = None
        try:
            while True:
                item = self._queue.get()
                try:
                    if item is _STOP:
                        break
                    self._write(fh, item)
                finally:
                    self._queue.task_done()
        finally:
            if fh is not None:
                fh.close()

    def _write(self, fh: IO[str] | None, item: object) -> None:
        if fh is None or not isinstance(item, TurnEvent):
            self._count_error()
            return
        try:
            fh.write(item.to_json() + "\n")
            if self._queue.unfinished_tasks <= 1:
                fh.flush()
            self.written += 1
        except (OSError, TypeError, ValueError) as exc:
            self._count_error()
            _logger.warning("event write to %s failed: %s", self.path, exc)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued event is written (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks > 0:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush queued events and stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            _logger.warning("event sink queue still full at close; events dropped")
        self._thread.join(timeout)
