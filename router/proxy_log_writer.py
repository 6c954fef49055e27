"""``--proxy-log FILE``: the text lines vLLM's ``disagg_proxy_multiturn.py`` writes, byte for byte.

Stock tooling (the AWS blog's scripts scrape ``Prefill done in``; operators grep ``cache MISS``)
keeps working behind kvdiag's router. Format and messages are the example proxy's:
``%(asctime)s [%(levelname)s] %(name)s: %(message)s``, datefmt ``%Y-%m-%d %H:%M:%S``, logger
``disagg_proxy``. Lines go through a bounded queue to a writer thread, so a slow disk never stalls
a turn; lines that do not fit are dropped and counted.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Final

LOGGER_NAME: Final = "disagg_proxy"
LOG_FORMAT: Final = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
DATE_FORMAT: Final = "%Y-%m-%d %H:%M:%S"

NO_CONVERSATION_ID_MSG: Final = (
    "[%s] No conversation_id provided — KV cache reuse disabled for this request. Add a "
    "'conversation_id' field to enable cross-turn KV sharing. When using "
    "benchmarks/multi_turn/benchmark_serving_multi_turn.py, pass --send-conversation-id (off by default).")


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    def __init__(self, q: queue.Queue[logging.LogRecord], on_drop: Callable[[], None] | None) -> None:
        super().__init__(q)
        self.dropped = 0
        self._on_drop = on_drop

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()


class ProxyLog:
    """Writes the example proxy's messages to ``path``; every method is cheap and never raises."""

    def __init__(self, path: str | Path, max_queue: int = 10_000, on_drop: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self._file = logging.FileHandler(self.path, encoding="utf-8")
        self._file.setFormatter(logging.Formatter(LOG_FORMAT, datefmt=DATE_FORMAT))
        q: queue.Queue[logging.LogRecord] = queue.Queue(maxsize=max_queue)
        self._queue_handler = _DroppingQueueHandler(q, on_drop)
        self._listener = logging.handlers.QueueListener(q, self._file)
        # A private logger object named like the proxy's: records carry name "disagg_proxy" without
        # touching the process-wide logger of that name.
        self._logger = logging.Logger(LOGGER_NAME, logging.INFO)
        self._logger.addHandler(self._queue_handler)
        self._logger.propagate = False
        self._listener.start()

    @property
    def dropped(self) -> int:
        """Lines dropped because the queue was full."""
        return self._queue_handler.dropped

    def ready(self, n_prefill: int, n_decode: int) -> None:
        """Startup line."""
        self._logger.info("Ready: %d prefill, %d decode instances", n_prefill, n_decode)

    def no_conversation_id(self, request_id: str) -> None:
        """The request carried no conversation_id."""
        self._logger.warning(NO_CONVERSATION_ID_MSG, request_id)

    def stale(self, conv: str, age: float, ttl: float) -> None:
        """The entry was older than the TTL and was discarded."""
        self._logger.info("conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding", conv, age, ttl)

    def hit(self, conv: str, age: float) -> None:
        """A handle was found."""
        self._logger.info("conv=%s: cache HIT (age=%.1fs)", conv, age)

    def sending(self, request_id: str, conv: str, remote_request_id: object) -> None:
        """The handle goes to P."""
        self._logger.info("[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
                          request_id, conv, remote_request_id)

    def miss(self, request_id: str, conv: str) -> None:
        """No handle for this turn."""
        self._logger.info("[%s] conv=%s: cache MISS", request_id, conv)

    def history_changed(self, conv: str) -> None:
        """The prompt reproduces no earlier turn: D's handle is not injected (the reference proxy's line)."""
        self._logger.info("conv=%s: cache MISS (request history changed)", conv)

    def not_validated(self, conv: str) -> None:
        """D's reply cannot be checked against the next prompt (reasoning, tool calls, hidden output)."""
        self._logger.info("conv=%s: not caching D blocks because response history cannot be validated", conv)

    def unsupported_shape(self, conv: str) -> None:
        """The request's shape cannot be checked against the next one: D's handle is not kept."""
        self._logger.info("conv=%s: not caching D blocks for unsupported request shape", conv)

    def prefill_done(self, request_id: str, ms: float) -> None:
        """The prefill leg finished."""
        self._logger.info("[%s] Prefill done in %.0fms", request_id, ms)

    def cached(self, conv: str, remote_request_id: object, blocks: int) -> None:
        """D's params were stored for the next turn."""
        self._logger.info("conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)", conv, remote_request_id,
                          blocks)

    def close(self) -> None:
        """Flush queued lines and close the file."""
        try:
            self._listener.stop()
        finally:
            self._file.close()
