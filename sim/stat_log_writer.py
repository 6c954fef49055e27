"""vLLM's periodic stat lines for an emulated engine (``Engine 000: ...`` then ``KV Transfer metrics: ...``).

Written by the API-server process every ``VLLM_LOG_STATS_INTERVAL`` seconds, as vLLM 0.33's
LoggingStatLogger writes them: the Engine line first, then the connector's line when the interval saw
a transfer, a failure, an expiry or a late notification. Both are demoted to DEBUG when the engine was
idle (no throughput) in this and the previous interval. The prompt throughput counts computed tokens
(cached and transferred ones excluded); the two hit rates aggregate the last 1000 requests, not the
interval, and appear once a request was looked up.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from kvdiag.sim import vllm_log_writer as vl

if TYPE_CHECKING:
    from kvdiag.sim.emulated_engine import Engine


def _p90(values: list[float]) -> float:
    """numpy's default (linear) 90th percentile, as vLLM's NIXL stats compute it."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = 0.9 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class CachingRate:
    """A hit rate over the most recent requests (vLLM's CachingMetrics, 1000 requests)."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent = max_recent_requests
        self.requests = self.queries = self.hits = 0
        self._queue: deque[tuple[int, int]] = deque()

    def observe(self, queries: int, hits: int) -> None:
        """One request looked up ``queries`` tokens and found ``hits``."""
        self._queue.append((queries, hits))
        self.requests += 1
        self.queries += queries
        self.hits += hits
        while len(self._queue) > 1 and self.requests > self.max_recent:
            q, h = self._queue.popleft()
            self.requests -= 1
            self.queries -= q
            self.hits -= h

    @property
    def empty(self) -> bool:
        """No request observed yet."""
        return self.requests == 0

    @property
    def rate(self) -> float:
        """Hits per queried token (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class StatsLogger:
    """Accumulates one interval's counts and writes the stat lines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last = time.monotonic()
        self.handshaken: set[str] = set()
        self.local = CachingRate()
        self.external = CachingRate()
        self._last_busy = False  # vLLM starts from zero throughputs: a first idle interval is DEBUG
        self._reset()

    def _reset(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.transfers: list[tuple[float, float, int, int]] = []
        self.failed_transfers = 0
        self.expired_reqs = 0
        self.notifs_after_expiry = 0

    def maybe_log(self) -> None:
        """Write the lines if the interval has elapsed."""
        now = time.monotonic()
        interval = self.engine.config.log_stats_interval_s
        if interval <= 0 or now - self.last < interval:
            return
        elapsed = now - self.last
        self.last = now
        self.log(elapsed)

    def log(self, elapsed: float) -> None:
        """Write this interval's lines and start a new interval."""
        eng = self.engine
        busy = self.prompt_tokens > 0 or self.generation_tokens > 0
        level = "INFO" if busy or self._last_busy else "DEBUG"
        self._last_busy = busy
        msg = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
               "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%")
        args: list[object] = [0, self.prompt_tokens / elapsed, self.generation_tokens / elapsed, eng.running,
                              eng.waiting, eng.pool.usage * 100.0]
        if not self.local.empty:
            msg += ", Prefix cache hit rate: %.1f%%"
            args.append(100.0 * self.local.rate)
        if not self.external.empty:
            msg += ", External prefix cache hit rate: %.1f%%"
            args.append(100.0 * self.external.rate)
        eng.log.log(level, "engine_stats", msg, *args, process=vl.API)
        if self.transfers or self.failed_transfers or self.expired_reqs or self.notifs_after_expiry:
            eng.log.log(level, "kv_metrics", vl.MSG_KV_METRICS, self._kv_metrics(), process=vl.API)
        eng.metrics.kv_cache_usage_perc.set(eng.pool.usage)
        self._reset()

    def _kv_metrics(self) -> str:
        """NIXL's reduced stats, as ``NixlKVConnectorStats.reduce`` words and rounds them."""
        n = len(self.transfers)
        failures = {"Num failed transfers": self.failed_transfers, "Num KV expired reqs": self.expired_reqs,
                    "Num notifs after expiry": self.notifs_after_expiry}
        if not n:
            parts: dict[str, object] = {
                "Num successful transfers": 0, "Avg xfer time (ms)": 0, "P90 xfer time (ms)": 0,
                "Avg post time (ms)": 0, "P90 post time (ms)": 0, "Avg MB per transfer": 0, "Throughput (MB/s)": 0,
                "Avg number of descriptors": 0, **failures}
        else:
            xfer = [t[0] for t in self.transfers]
            post = [t[1] for t in self.transfers]
            total_mb = sum(t[2] for t in self.transfers) / 2**20
            total_s = sum(xfer) / 1000.0
            parts = {
                "Num successful transfers": n,
                "Avg xfer time (ms)": round(sum(xfer) / n, 3),
                "P90 xfer time (ms)": round(_p90(xfer), 3),
                "Avg post time (ms)": round(sum(post) / n, 3),
                "P90 post time (ms)": round(_p90(post), 3),
                "Avg MB per transfer": round(total_mb / n, 3),
                "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
                "Avg number of descriptors": round(sum(t[3] for t in self.transfers) / n, 1),
                **failures}
        return ", ".join(f"{k}={v}" for k, v in parts.items())
