"""vLLM's periodic stat lines for an emulated engine (``KV Transfer metrics: ...`` and ``Engine 000: ...``).

Written by the API-server process every ``VLLM_LOG_STATS_INTERVAL`` seconds; demoted to DEBUG when
the engine was idle (no throughput) in the last two intervals, as vLLM's LoggingStatLogger does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvdiag.sim import vllm_log as vl

if TYPE_CHECKING:
    from kvdiag.sim.engine import Engine


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else 0.0


class StatsLogger:
    """Accumulates one interval's counts and writes the stat lines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last = time.monotonic()
        self.handshaken: set[str] = set()
        self._planned: set[str] = set()  # peers whose "Transfer plan" line is written
        self._idle_intervals = 0
        self._reset()

    def _reset(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.queries = 0
        self.hits = 0
        self.external_hits = 0
        self.transfers: list[tuple[float, float, int, int]] = []
        self.failed_transfers = 0
        self.expired_reqs = 0

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
        # vLLM's worker logs its plan for each peer it first reads from (one TP rank each side here); the
        # emulation writes it with the interval's lines, which is all a log reader needs of it.
        for peer in sorted(self.handshaken - self._planned):
            self._planned.add(peer)
            eng.log.log("INFO", "transfer_plan", vl.MSG_TRANSFER_PLAN, 1, 8, 1, 1, 0, 1, 1, 0,
                        eng.config.block_size * 8 * 128 * 2 * 2)
        if len(self._planned) > 1024:
            self._planned.clear()
        idle = self.prompt_tokens == 0 and self.generation_tokens == 0
        self._idle_intervals = self._idle_intervals + 1 if idle else 0
        level = "DEBUG" if self._idle_intervals >= 2 else "INFO"
        if self.transfers or self.failed_transfers or self.expired_reqs:
            n = len(self.transfers)
            xfer = [t[0] for t in self.transfers]
            post = [t[1] for t in self.transfers]
            total_mb = sum(t[2] for t in self.transfers) / 2**20
            total_s = sum(xfer) / 1000.0
            parts = {
                "Num successful transfers": n,
                "Avg xfer time (ms)": round(sum(xfer) / n, 3) if n else 0,
                "P90 xfer time (ms)": round(_p90(xfer), 3),
                "Avg post time (ms)": round(sum(post) / n, 3) if n else 0,
                "P90 post time (ms)": round(_p90(post), 3),
                "Avg MB per transfer": round(total_mb / n, 3) if n else 0,
                "Throughput (MB/s)": round(total_mb / total_s, 3) if total_s > 0 else 0,
                "Avg number of descriptors": round(sum(t[3] for t in self.transfers) / n, 1) if n else 0,
                "Num failed transfers": self.failed_transfers,
                "Num KV expired reqs": self.expired_reqs,
                "Num notifs after expiry": 0,
            }
            eng.log.log(level, "kv_metrics", vl.MSG_KV_METRICS, ", ".join(f"{k}={v}" for k, v in parts.items()),
                        process=vl.API)
        msg = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
               "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%")
        args: list[object] = [0, self.prompt_tokens / elapsed, self.generation_tokens / elapsed, eng.running,
                              eng.waiting, eng.pool.usage * 100.0]
        if eng.faults.prefix_caching:
            msg += ", Prefix cache hit rate: %.1f%%"
            args.append(100.0 * self.hits / self.queries if self.queries else 0.0)
        if self.external_hits:
            msg += ", External prefix cache hit rate: %.1f%%"
            args.append(100.0 * self.external_hits / self.queries if self.queries else 0.0)
        eng.log.log(level, "engine_stats", msg, *args, process=vl.API)
        eng.metrics.kv_cache_usage_perc.set(eng.pool.usage)
        self._reset()
