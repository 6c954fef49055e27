"""Catch, count and log errors inside the instrumentation: observation never fails a request.

Usage::

    guard = Guard("scheduler")
    with guard:
        record_something()      # any Exception is swallowed, counted in guard.errors, logged

    try:                        # the same on a hot path, without the context-manager calls
        record_something()
    except Exception as exc:
        guard.caught(exc)
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

# Under vLLM's logger tree, so inside an engine the line gets vLLM's handler and format in its log.
_logger = logging.getLogger("vllm.kvdiag")

_LOG_INTERVAL_S = 10.0  # at most one traceback per interval: a broken hook fires every step


class Guard:
    """A reusable context manager that swallows ``Exception`` (not BaseException) and counts it."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.errors = 0
        self._unreported = 0
        self._last_log = 0.0

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False
        self.caught(exc)
        return True

    def caught(self, exc: Exception) -> None:
        """Count and (rate-limited) log an exception the caller has already swallowed."""
        self.errors += 1
        self._unreported += 1
        now = time.monotonic()
        if now - self._last_log >= _LOG_INTERVAL_S:
            self._last_log = now
            _logger.warning("kvdiag instrumentation error in %s (%d so far); the request is unaffected",
                            self.where, self.errors, exc_info=exc)

    @property
    def pending(self) -> int:
        """Errors counted but not yet taken by ``take_unreported`` (cheap per-step check)."""
        return self._unreported

    def count(self) -> None:
        """Count an error handled elsewhere (e.g. a dropped event)."""
        self.errors += 1
        self._unreported += 1

    def take_unreported(self) -> int:
        """Errors since the last call (fed to kvdiag_emit_errors_total)."""
        count, self._unreported = self._unreported, 0
        return count
