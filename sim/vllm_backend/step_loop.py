"""The real-vLLM engine's step loop, stat lines and connector metrics, between the HTTP handlers and vLLM.

One ``CpuEngine`` (vLLM's Scheduler, kvdiag's connector in both roles, NIXL on CPU) per process;
handlers submit requests and await their outputs while the loop steps the engine on the event
loop between requests, as EngineCore's busy loop does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import prometheus_client

from kvdiag.sim.tokenizer import generate_reply
from kvdiag.sim.vllm_backend.options import Options

_logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """One request between the HTTP handler and the step loop."""

    engine_id: str
    kind: str
    prompt: list[int]
    request: Any = None
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class VllmBackend:
    """The real-vLLM engine and its step loop; HTTP handlers submit requests and await outputs."""

    def __init__(self, opts: Options, work_dir: Path) -> None:
        # vLLM is imported on first use (VLLM_TARGET_DEVICE must be set before its platform resolves,
        # and --help should not pay its ~5 s import).
        from kvdiag.sim.vllm_backend.cpu_engine import CpuEngine, write_model_dir  # noqa: PLC0415

        affinity = os.sched_getaffinity(0)
        self.opts = opts
        extra: dict[str, Any] = {"bidirectional_kv_xfer": opts.bidirectional,
                                 "decoder_kv_blocks_ttl": opts.decoder_kv_blocks_ttl,
                                 "kv_lease_duration": opts.kv_lease_duration, "kvdiag_role": opts.role,
                                 "kvdiag_pull_matching_prefix": opts.pull_matching_prefix,
                                 "kvdiag_digest": opts.prefix_digest}
        if opts.kv_recompute_threshold is not None:
            extra["kv_recompute_threshold"] = opts.kv_recompute_threshold
        if opts.events_file:
            extra["kvdiag_events_file"] = opts.events_file
        connector: dict[str, Any] = {}
        if opts.connector == "nixl":  # stock vLLM: its NixlConnector, none of kvdiag's keys
            extra = {k: v for k, v in extra.items() if not k.startswith("kvdiag_")}
            connector["connector"] = "NixlConnector"
        # vLLM's NIXL compatibility hash covers the model path: P and D share one model directory.
        model_dir = write_model_dir(Path(tempfile.gettempdir()) / "kvdiag-vllm-cpu-model")
        self.engine = CpuEngine("P" if opts.role == "prefill" else "D", model_dir, work_dir,
                                writer_tag=1 if opts.role == "prefill" else 2, num_blocks=opts.num_blocks,
                                extra=extra, prefix_caching=opts.prefix_caching, engine_id=opts.engine_id,
                                served_model_name=opts.model, side_channel_port=opts.side_channel_port or None,
                                kv_load_failure_policy=opts.kv_load_failure_policy, **connector)
        os.sched_setaffinity(0, affinity)  # vLLM's CPU platform pinned us to one core
        self.engine.on_output = self._on_output
        self.pending: dict[str, Pending] = {}
        self._wake = asyncio.Event()
        self._closed = False
        self.metrics = _Metrics(self.engine)
        self.stat_log = _StatLog(self.engine)
        self.engine.on_stats = self.stat_log.record

    @property
    def engine_id(self) -> str:
        return str(self.engine.engine_id)

    def submit(self, pending: Pending, max_tokens: int, params: dict[str, Any] | None, seed: int) -> None:
        """Add the request to vLLM's scheduler (the sampler's reply planned from the prompt)."""
        self.engine.reply_plans[pending.engine_id] = generate_reply(seed, pending.prompt, max_tokens)
        pending.request = self.engine.add(pending.engine_id, pending.prompt, max_tokens=max_tokens,
                                          kv_transfer_params=params)
        self.pending[pending.engine_id] = pending
        self._wake.set()

    def _on_output(self, out: Any) -> None:
        pending = self.pending.get(out.request_id)
        if pending is None:
            return
        pending.queue.put_nowait(out)
        if out.finish_reason is not None:
            self.pending.pop(out.request_id, None)
            self.engine.reply_plans.pop(out.request_id, None)

    async def run(self) -> None:
        """EngineCore's busy loop: step while anything is scheduled or held, else idle-poll (leases)."""
        while not self._closed:
            if self.engine.scheduler.has_requests():
                try:
                    self.engine.step()
                except Exception:  # a broken step must not wedge the server silently
                    _logger.exception("engine step failed")
                    for pending in list(self.pending.values()):
                        pending.queue.put_nowait(None)
                    self.pending.clear()
                self.metrics.observe()
                await asyncio.sleep(0)
            else:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)

    async def log_stats(self) -> None:
        """The API server's ``_force_log`` loop: vLLM's stat lines every interval."""
        interval = self.stat_log.interval(self.opts.log_stats_interval)
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                self.stat_log.log()
            except Exception:  # a stats bug must not stop the server
                _logger.exception("stat logging failed")

    def close(self) -> None:
        self._closed = True
        self.engine.shutdown()


class _StatLog:
    """vLLM 0.33's ``LoggingStatLogger``, fed as AsyncLLM's output handler feeds it.

    Every engine step hands over the scheduler's ``SchedulerStats`` (with the connector's stats) and
    the step's outputs, which become an ``IterationStats`` through vLLM's own ``update_from_output``
    (prompt tokens computed, generation tokens). ``log()`` writes the ``Engine 000: …`` line and NIXL's
    ``KV Transfer metrics: …`` line exactly as ``vllm serve`` does, as the API server process.
    """

    _API_LOGGERS: Final = ("vllm.v1.metrics.loggers", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
                           "vllm.entrypoints.generate.base.serving")
    MAX_TRACKED: Final = 65536

    def __init__(self, engine: Any) -> None:
        from vllm.v1.metrics.loggers import LoggingStatLogger  # noqa: PLC0415 (see VllmBackend.__init__)
        from vllm.v1.metrics.stats import LoRARequestStates  # noqa: PLC0415

        self.logger = LoggingStatLogger(engine.vllm_config, 0)
        self.lora = LoRARequestStates(log_stats=True)
        self.requests: dict[str, Any] = {}  # request id -> RequestStateStats, until it finishes
        for name in self._API_LOGGERS:
            logging.getLogger(name).addFilter(_as_api_server)

    @staticmethod
    def interval(option: float | None) -> float:
        """The option, else vLLM's ``VLLM_LOG_STATS_INTERVAL`` (10 s; non-positive values mean 10)."""
        if option is not None and option > 0:
            return float(option)
        import vllm.envs as envs  # noqa: PLC0415

        return float(envs.VLLM_LOG_STATS_INTERVAL)

    def record(self, stats: Any, outputs: list[Any], timestamp: float) -> None:
        from vllm.v1.metrics.stats import IterationStats, RequestStateStats  # noqa: PLC0415

        iteration = IterationStats() if outputs else None
        for out in outputs:
            assert iteration is not None
            req = self.requests.get(out.request_id)
            prefilling = req is None
            if req is None:
                if len(self.requests) >= self.MAX_TRACKED:
                    del self.requests[next(iter(self.requests))]
                req = self.requests[out.request_id] = RequestStateStats(arrival_time=time.time())
            iteration.update_from_output(out, timestamp, prefilling, req, self.lora, None)
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
        self.logger.record(scheduler_stats=stats, iteration_stats=iteration)

    def log(self) -> None:
        self.logger.log()


def _as_api_server(record: logging.LogRecord) -> bool:
    """vLLM writes its stat and serving lines in the API server process: name them so here."""
    record.vllm_process_name = "APIServer"
    return True


class _Metrics:
    """vLLM's KVConnectorProm (NIXL's and kvdiag's connector series) in a private registry."""

    def __init__(self, engine: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: PLC0415

        self.registry = prometheus_client.CollectorRegistry()
        bound = {kind: _bind(getattr(prometheus_client, kind), self.registry)
                 for kind in ("Gauge", "Counter", "Histogram")}
        prom_cls = type("_Prom", (KVConnectorProm,), {"_gauge_cls": bound["Gauge"], "_counter_cls": bound["Counter"],
                                                     "_histogram_cls": bound["Histogram"]})
        model = engine.vllm_config.model_config.served_model_name
        self.prom = prom_cls(engine.vllm_config, ["model_name", "engine"], {0: [str(model), "0"]})
        self.engine = engine

    def observe(self) -> None:
        for payload in self.engine.stats:
            self.prom.observe(payload, 0)
        self.engine.stats.clear()

    def exposition(self) -> bytes:
        data: bytes = prometheus_client.generate_latest(self.registry)
        return data


def _bind(base: Any, registry: Any) -> Any:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("registry", registry)
        base.__init__(self, *args, **kwargs)

    return type(f"Bound{base.__name__}", (base,), {"__init__": init})
