"""``KVDiagNixlConnector``: vLLM's NixlConnector with kvdiag's per-request observation.

Load it in vLLM with (docs/connector.md has the full P and D configs)::

    --kv-transfer-config '{"kv_connector": "KVDiagNixlConnector",
        "kv_connector_module_path": "kvdiag.instrumentation.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": true,
                                      "kvdiag_events_file": "/var/log/kvdiag/prefill-events.jsonl"}}'

It changes no transfer behaviour: every hook calls NixlConnector's and then records what
happened (errors in the recording are caught, counted and logged). It adds:

* on P, ``kv_transfer_params["kvdiag"]``: the PrefillReport (Contract 4 outcome, tokens, NIXL's
  bytes and milliseconds of the D->P read) so the router learns each turn's outcome;
* on D, ``kv_transfer_params["kvdiag_digest"]``: a compact digest of the held sequence's block
  hashes; P compares it with its prompt and reports ``prefix_mismatch`` (vLLM issue #43094).
  With ``kvdiag_pull_matching_prefix: true`` P reads only the matching blocks;
* TurnEvents (``prefill_request``; ``decode_request``, ``kv_retained``, ``kv_released``) to a
  bounded, non-blocking JSON-lines file;
* ``kvdiag_connector_*`` metrics on vLLM's ``/metrics`` via ``build_prom_metrics``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.v1.request import RequestStatus

from kvdiag.diagnostics.vllm_log import header_request_id
from kvdiag.exporters.jsonl import EventSink
from kvdiag.instrumentation.guard import Guard
from kvdiag.instrumentation.report import DIGEST_KEY, DigestError, PrefillView, first_mismatch, make_digest
from kvdiag.instrumentation.stats import KVDiagNixlStats, KVDiagPromMetrics
from kvdiag.instrumentation.worker import ObservedPullWorker
from kvdiag.schema.events import REPORT_FIELDS, REPORT_KEY, TurnEvent, now_ts

_logger = logging.getLogger(__name__)

EVENTS_FILE_ENV: Final = "KVDIAG_EVENTS_FILE"
MAX_TRACKED: Final = 65_536          # requests in flight we keep facts for (oldest dropped beyond)
STATS_INTERVAL_S: Final = 0.25       # scheduler-side counters ship to the API server at most this often
_HANDLE_KEYS: Final = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_OK_STATUSES: Final = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


@dataclass(frozen=True)
class KVDiagConfig:
    """kvdiag's keys in ``kv_connector_extra_config`` (all optional)."""

    events_file: str | None = None
    sink_capacity: int = 10_000
    digest: bool = True                  # D: add kvdiag_digest to its returned params
    pull_matching_prefix: bool = False   # P: on prefix_mismatch read only the matching blocks
    role: str | None = None              # "prefill" or "decode": this engine's role (engine_start event)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> KVDiagConfig:
        """Read the config; a wrong type raises ValueError naming the key (at engine start)."""
        extra = extra or {}
        events_file = extra.get("kvdiag_events_file", os.environ.get(EVENTS_FILE_ENV))
        if events_file is not None and not isinstance(events_file, str):
            raise ValueError("kv_connector_extra_config.kvdiag_events_file must be a path string")
        capacity = extra.get("kvdiag_sink_capacity", 10_000)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError("kv_connector_extra_config.kvdiag_sink_capacity must be a positive integer")
        flags = {}
        for key, default in (("kvdiag_digest", True), ("kvdiag_pull_matching_prefix", False)):
            value = extra.get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"kv_connector_extra_config.{key} must be true or false")
            flags[key] = value
        role = extra.get("kvdiag_role")
        if role not in (None, "prefill", "decode"):
            raise ValueError('kv_connector_extra_config.kvdiag_role must be "prefill" or "decode"')
        return cls(events_file=events_file or None, sink_capacity=capacity, digest=flags["kvdiag_digest"],
                   pull_matching_prefix=flags["kvdiag_pull_matching_prefix"], role=role)


@dataclass
class _DecodeView:
    """Facts D gathers for one request it decodes (P->D read, then retention)."""

    engine_request_id: str
    prompt_tokens: int
    remote_engine_id: str | None
    remote_request_id: str | None
    local_hit_tokens: int = 0
    remote_read_tokens: int = 0
    read_ok: bool = False
    failure_type: str | None = None
    transfer_bytes: int = 0
    transfer_ms: float = 0.0


@dataclass
class _Tracked:
    role: str
    arrival: float
    prefill: PrefillView | None = None
    decode: _DecodeView | None = None
    status: str | None = None
    completion_tokens: int | None = None
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Retained:
    since: float
    blocks: int
    ttl_s: float


def _status_of(status: Any) -> str:
    if status in _OK_STATUSES:
        return "ok"
    return "aborted" if status == RequestStatus.FINISHED_ABORTED else "error"


class KVDiagNixlConnector(NixlConnector):  # type: ignore[misc]
    """NixlConnector (pull) that observes every request; see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # Same construction as NixlPullConnector, with the observing worker in the WORKER role.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        self.kvdiag_config = KVDiagConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.kvdiag_guard = Guard("connector")
        self._kvdiag_sink: EventSink | None = None
        self._kvdiag_stats = KVDiagNixlStats()
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()
        self._pending: OrderedDict[str, _Tracked] = OrderedDict()
        self._retained: OrderedDict[str, _Retained] = OrderedDict()
        self._retained_reported = 0
        self._stats_shipped = 0.0
        self._model = str(getattr(vllm_config.model_config, "served_model_name", None) or "") or None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
            if self.kvdiag_config.events_file:
                self._kvdiag_sink = EventSink(self.kvdiag_config.events_file,
                                              max_queue=self.kvdiag_config.sink_capacity,
                                              on_error=self._count_sink_error)
            with self.kvdiag_guard:
                self._engine_start(vllm_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = ObservedPullWorker(vllm_config, self.engine_id, kv_cache_config,
                                                       guard=self.kvdiag_guard)

    def _engine_start(self, vllm_config: VllmConfig) -> None:
        kv = vllm_config.kv_transfer_config
        sched = self._sched
        attrs = {"pid": os.getpid(), "side_channel_port": int(sched.side_channel_port),
                 "block_size": int(sched.block_size), "num_blocks": vllm_config.cache_config.num_gpu_blocks,
                 "bidirectional_kv_xfer": self._bidirectional,
                 "kv_recompute_threshold": int(sched.kv_recompute_threshold),
                 "decoder_kv_blocks_ttl": float(sched.decoder_kv_blocks_ttl),
                 "prefix_caching": bool(vllm_config.cache_config.enable_prefix_caching),
                 "kv_load_failure_policy": str(getattr(kv, "kv_load_failure_policy", "fail")),
                 "connector": type(self).__name__}
        # kv_both serves either role (each request's events carry its own); kvdiag_role names this engine's.
        role = self.kvdiag_config.role or ("decode" if kv.kv_role == "kv_consumer" else "prefill")
        self._emit(source=role, event="engine_start", engine_id=self.engine_id,
                   model=self._model, attrs=attrs)

    # --- vLLM's connector hooks (scheduler side) ------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        with self.kvdiag_guard:
            self._track(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        with self.kvdiag_guard:
            self._on_matched(request, num_computed_tokens, result)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pulling_from_d = False
        with self.kvdiag_guard:  # read before vLLM marks the handle processed
            params = request.kv_transfer_params or {}
            pulling_from_d = bool(params.get("do_remote_decode") and params.get("remote_block_ids")
                                  and not params.get("_remote_blocks_processed"))
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        with self.kvdiag_guard:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None and tracked.prefill is not None and pulling_from_d and num_external_tokens > 0 \
                    and self._bidirectional:
                tracked.prefill.read_started(num_external_tokens)
            elif tracked is not None and tracked.decode is not None and num_external_tokens > 0:
                tracked.decode.remote_read_tokens = num_external_tokens

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        with self.kvdiag_guard:
            self._on_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        with self.kvdiag_guard:
            params = self._on_finished(request, (block_ids,), delay, params)
        return delay, params

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        with self.kvdiag_guard:
            params = self._on_finished(request, block_ids, delay, params)
        return delay, params

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            worker_stats: KVConnectorStats | None = super().get_kv_connector_stats()
            return worker_stats
        with self.kvdiag_guard:
            return self._scheduler_stats()
        return None

    def _scheduler_stats(self) -> KVConnectorStats | None:
        if len(self._retained) != self._retained_reported:
            self._retained_reported = len(self._retained)
            self._kvdiag_stats.data["kvdiag_retained"].append(self._retained_reported)
        errors = self.kvdiag_guard.take_unreported()
        if errors:
            self._kvdiag_stats.data["kvdiag_emit_errors"].extend([1] * errors)
        if self._kvdiag_stats.is_empty():
            return None
        # Counters ship at most every STATS_INTERVAL_S while requests are in flight (Prometheus needs no
        # per-step granularity; each shipment costs vLLM an aggregate and a payload), at once when idle.
        now = time.monotonic()
        if self._tracked and now - self._stats_shipped < STATS_INTERVAL_S:
            return None
        self._stats_shipped = now
        stats: KVConnectorStats = self._kvdiag_stats.clone_and_reset()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVDiagNixlStats(data=data) if data is not None else KVDiagNixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return KVDiagPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        super().shutdown()
        if self._kvdiag_sink is not None:
            self._kvdiag_sink.close()

    # --- observation ----------------------------------------------------------------------------

    @property
    def _sched(self) -> Any:
        return self.connector_scheduler

    @property
    def _bidirectional(self) -> bool:
        return bool(self._sched.is_bidirectional_kv_xfer_enabled)

    @property
    def _block_size(self) -> int:
        return int(self._sched.block_size)

    def _remember(self, table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        while len(table) > MAX_TRACKED:
            table.popitem(last=False)

    def _track(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return
        req_id = request.request_id
        if params.get("do_remote_decode"):
            has_handle = bool(params.get("remote_block_ids")) and all(k in params for k in _HANDLE_KEYS)
            offered = params.get("remote_num_tokens") if has_handle else 0
            view = PrefillView(
                engine_request_id=req_id, prompt_tokens=int(request.num_prompt_tokens), block_size=self._block_size,
                has_handle=has_handle, engine_id=self.engine_id,
                remote_engine_id=str(params["remote_engine_id"]) if has_handle else None,
                remote_request_id=str(params["remote_request_id"]) if has_handle else None,
                remote_offered_tokens=offered if isinstance(offered, int) and offered > 0 else 0)
            if has_handle and DIGEST_KEY in params and self._bidirectional:
                self._check_digest(request, params, view)
            self._remember(self._tracked, req_id, _Tracked("prefill", time.monotonic(), prefill=view))
        elif params.get("do_remote_prefill"):
            view_d = _DecodeView(engine_request_id=req_id, prompt_tokens=int(request.num_prompt_tokens),
                                 remote_engine_id=_str_or_none(params.get("remote_engine_id")),
                                 remote_request_id=_str_or_none(params.get("remote_request_id")))
            self._remember(self._tracked, req_id, _Tracked("decode", time.monotonic(), decode=view_d))

    def _check_digest(self, request: Any, params: dict[str, Any], view: PrefillView) -> None:
        try:
            mismatch, matched = first_mismatch(params[DIGEST_KEY], list(request.block_hashes), self._block_size)
        except DigestError as exc:
            view.attrs["digest_error"] = str(exc)
            return
        if mismatch is None:
            return
        view.mismatch_block = mismatch
        view.attrs["matching_blocks"] = matched
        if self.kvdiag_config.pull_matching_prefix:
            # Opt-in: shrink the handle to the blocks that match, so vLLM's own count
            # (min(remote_num_tokens, prompt) - local) and end-trim read exactly those blocks.
            matched_tokens = matched * self._block_size
            params["remote_num_tokens"] = min(view.remote_offered_tokens, matched_tokens)
            params["remote_block_ids"] = [list(group)[:matched] for group in params["remote_block_ids"]]
            view.attrs["pulled_matching_prefix"] = True

    def _on_matched(self, request: Any, num_computed_tokens: int, result: tuple[int | None, bool]) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        if tracked.decode is not None:
            tracked.decode.local_hit_tokens = num_computed_tokens
            return
        view = tracked.prefill
        if view is None or not view.has_handle:
            return
        view.local_hit_tokens = num_computed_tokens
        remainder = view.remainder_tokens
        threshold = int(self._sched.kv_recompute_threshold)
        skipped = self._bidirectional and remainder > 0 and threshold > 0 and remainder < threshold \
            and not result[0]
        if skipped and not view.threshold_skipped:
            self._kvdiag_stats.data["kvdiag_threshold_skips"].append(1)
        view.threshold_skipped = skipped

    def _on_connector_output(self, output: Any) -> None:
        stats = output.kv_connector_stats
        data = stats.data if stats is not None and isinstance(getattr(stats, "data", None), dict) else {}
        for row in data.get("kvdiag_xfers", ()):
            self._apply_xfer_row(row)
        if data.get("kvdiag_xfers"):
            data["kvdiag_xfers"] = []  # consumed here; no request ids travel on to the API server
        for req_id in data.get("kvdiag_expired", ()):
            self._release(str(req_id), "expired")
        if data.get("kvdiag_expired"):
            data["kvdiag_expired"] = []
        for req_id in output.finished_recving or ():
            tracked = self._tracked.get(req_id)
            if tracked is not None and tracked.prefill is not None and tracked.prefill.failure_type is None:
                tracked.prefill.read_ok = True
            elif tracked is not None and tracked.decode is not None and tracked.decode.failure_type is None:
                tracked.decode.read_ok = True
        for req_id in getattr(output, "failed_recving", None) or ():
            tracked = self._tracked.get(req_id) or self._pending.get(req_id)
            if tracked is not None and tracked.prefill is not None and tracked.prefill.failure_type is None:
                tracked.prefill.read_failed("unknown")
            if tracked is not None and tracked.decode is not None and tracked.decode.failure_type is None:
                tracked.decode.failure_type = "unknown"
        for req_id in output.finished_sending or ():
            self._release(req_id, "read")
        while self._pending:
            req_id, tracked = self._pending.popitem(last=False)
            self._emit_final(req_id, tracked, None)

    def _apply_xfer_row(self, row: Any) -> None:
        if not isinstance(row, list | tuple) or len(row) != 4:
            return
        req_id, nbytes, secs, failure = str(row[0]), int(row[1]), float(row[2]), str(row[3])
        tracked = self._tracked.get(req_id) or self._pending.get(req_id)
        if tracked is None:
            return
        if tracked.prefill is not None:
            if failure:
                tracked.prefill.read_failed(failure)
            else:
                tracked.prefill.read_done(nbytes, secs * 1000.0)
        elif tracked.decode is not None:
            if failure:
                tracked.decode.failure_type = failure
            else:
                tracked.decode.read_ok = True
                tracked.decode.transfer_bytes += nbytes
                tracked.decode.transfer_ms += secs * 1000.0

    def _on_finished(self, request: Any, block_ids: tuple[list[int], ...], delay: bool,
                     params: dict[str, Any] | None) -> dict[str, Any] | None:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return params
        tracked.status = _status_of(request.status)
        tracked.attrs["finish_status"] = str(request.status)
        reason = RequestStatus.get_finished_reason(request.status)
        tracked.attrs["finish_reason"] = str(reason) if reason is not None else None
        tracked.attrs["role"] = "P" if tracked.role == "prefill" else "D"
        tracked.completion_tokens = int(request.num_output_tokens)
        view = tracked.prefill
        if view is not None:
            view.request_failed = tracked.status != "ok"
            view.failed_reason = f"request finished {request.status}" if view.request_failed else None
            if view.pull_started and not view.read_ok and view.failure_type is None and view.request_failed:
                # vLLM fails a request whose load failed before it hands the connector the worker's
                # report of that step (update_connector_output runs later in the same step).
                self._remember(self._pending, request.request_id, tracked)
                return params
        if tracked.role == "decode" and delay and params is not None and params.get("do_remote_decode"):
            self._on_retained(request, params)
        return self._emit_final(request.request_id, tracked, params)

    def _on_retained(self, request: Any, params: dict[str, Any]) -> None:
        ttl = float(self._sched.decoder_kv_blocks_ttl)
        blocks = sum(len(group) for group in params.get("remote_block_ids") or ())
        if self.kvdiag_config.digest:
            held = int(params.get("remote_num_tokens") or 0) // self._block_size
            params[DIGEST_KEY] = make_digest([bytes(h) for h in request.block_hashes[:held]], self._block_size)
        self._remember(self._retained, request.request_id,
                       _Retained(time.monotonic(), blocks, ttl))
        self._emit(source="decode", event="kv_retained", engine_id=self.engine_id,
                   engine_request_id=request.request_id, request_id=header_request_id(request.request_id),
                   model=self._model, retained_blocks=blocks, ttl_s=ttl,
                   expiry_ts=round(time.time() + ttl, 3),
                   attrs={"remote_num_tokens": params.get("remote_num_tokens")})

    def _release(self, req_id: str, reason: str) -> None:
        held = self._retained.pop(req_id, None)
        if held is None:
            return
        self._kvdiag_stats.data["kvdiag_released"].append(reason)
        self._emit(source="decode", event="kv_released", engine_id=self.engine_id,
                   engine_request_id=req_id, request_id=header_request_id(req_id), model=self._model,
                   retained_blocks=held.blocks, ttl_s=held.ttl_s, release_reason=reason,
                   attrs={"held_s": round(time.monotonic() - held.since, 3)})

    def _emit_final(self, req_id: str, tracked: _Tracked, params: dict[str, Any] | None) -> dict[str, Any] | None:
        duration_ms = round((time.monotonic() - tracked.arrival) * 1000.0, 3)
        if tracked.prefill is not None:
            view = tracked.prefill
            report = view.report(bidirectional=self._bidirectional, threshold=int(self._sched.kv_recompute_threshold))
            if params is not None:
                # PrefillReport.to_dict without dataclasses.asdict's deep copy (hot path, flat fields)
                params[REPORT_KEY] = {k: v for k in REPORT_FIELDS if (v := getattr(report, k)) is not None}
            self._kvdiag_stats.data["kvdiag_requests"].append(["prefill", report.outcome])
            if report.remote_read_tokens:
                self._kvdiag_stats.data["kvdiag_read_tokens"].append(report.remote_read_tokens)
            attrs = {**view.attrs, **tracked.attrs}
            if view.threshold_skipped:
                attrs["threshold_skipped"] = True
            self._emit(
                source="prefill", event="prefill_request", engine_id=self.engine_id,
                engine_request_id=req_id, request_id=header_request_id(req_id), model=self._model,
                prompt_tokens=report.prompt_tokens, completion_tokens=tracked.completion_tokens,
                local_hit_tokens=report.local_hit_tokens, remote_offered_tokens=report.remote_offered_tokens,
                remote_read_tokens=report.remote_read_tokens,
                computed_tokens=report.computed_tokens, transfer_bytes=report.transfer_bytes,
                transfer_ms=report.transfer_ms, duration_ms=duration_ms, remote_engine_id=report.remote_engine_id,
                remote_request_id=report.remote_request_id, outcome=report.outcome, reason=report.reason,
                failure_type=report.failure_type, status=tracked.status, attrs=attrs)
        elif tracked.decode is not None:
            d = tracked.decode
            self._kvdiag_stats.data["kvdiag_requests"].append(["decode", "unknown"])
            self._emit(
                source="decode", event="decode_request", engine_id=self.engine_id,
                engine_request_id=req_id, request_id=header_request_id(req_id), model=self._model,
                prompt_tokens=d.prompt_tokens, completion_tokens=tracked.completion_tokens,
                local_hit_tokens=d.local_hit_tokens, remote_read_tokens=d.remote_read_tokens if d.read_ok else 0,
                computed_tokens=max(d.prompt_tokens - d.local_hit_tokens - (d.remote_read_tokens if d.read_ok else 0),
                                    0),
                transfer_bytes=d.transfer_bytes, transfer_ms=round(d.transfer_ms, 3), duration_ms=duration_ms,
                remote_engine_id=d.remote_engine_id, remote_request_id=d.remote_request_id,
                failure_type=d.failure_type, status=tracked.status,
                attrs={**tracked.attrs, "returned_handle": bool(params)})
        return params

    def _emit(self, **fields: Any) -> None:
        # Events are built only when a file sink is configured: no cost on the step otherwise.
        if self._kvdiag_sink is not None:
            self._kvdiag_sink.emit(TurnEvent(ts=now_ts(), **fields))

    def _count_sink_error(self) -> None:
        # Runs on the sink's thread: only bump counters; get_kv_connector_stats reports them.
        self.kvdiag_guard.count()

    def kvdiag_flush(self) -> None:
        """Write out every queued event (tests, shutdown)."""
        if self._kvdiag_sink is not None:
            self._kvdiag_sink.flush()


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
