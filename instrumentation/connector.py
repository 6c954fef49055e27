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
  hashes; P compares it with its prompt block by block (vLLM issue #43094) and, in exact mode
  (``kvdiag_pull_matching_prefix``, on by default), reads only the prefix the digest proves equal
  to its prompt, front-aligned to D's blocks; a divergence is reported as ``prefix_mismatch`` with
  ``mismatch_tokens``;
* TurnEvents (``prefill_request``; ``decode_request``, ``kv_retained``, ``kv_released``) to a
  bounded, non-blocking JSON-lines file;
* ``kvdiag_connector_*`` metrics on vLLM's ``/metrics`` via ``build_prom_metrics``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Final

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.request import RequestStatus

from kvdiag.instrumentation.guard import Guard
from kvdiag.instrumentation.sink import FieldsEventSink
from kvdiag.instrumentation.stats import KVDiagNixlStats, KVDiagPromMetrics
from kvdiag.instrumentation.worker import ObservedPullWorker
from kvdiag.schema.events import REPORT_KEY, now_ts
from kvdiag.schema.prefill_outcome import PrefillView
from kvdiag.schema.prefix_digest import DIGEST_KEY, DigestError, check_prefix, make_digest
from kvdiag.schema.request_ids import header_request_id

_logger = logging.getLogger(__name__)
# Under vLLM's logger tree, so inside an engine the line lands in vLLM's log with its format.
_vllm_logger = logging.getLogger("vllm.kvdiag")

EVENTS_FILE_ENV: Final = "KVDIAG_EVENTS_FILE"
MAX_TRACKED: Final = 65_536          # requests in flight we keep facts for (oldest dropped beyond)
STATS_INTERVAL_S: Final = 0.25       # scheduler-side counters ship to the API server at most this often
_OK_STATUSES: Final = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
_DECODE_ROW: Final = ("decode", "unknown")   # kvdiag_requests row of a D request (outcomes are P's)


@dataclass(frozen=True)
class KVDiagConfig:
    """kvdiag's keys in ``kv_connector_extra_config`` (all optional)."""

    events_file: str | None = None
    sink_capacity: int = 10_000
    digest: bool = True                  # D: add kvdiag_digest to its returned params
    pull_matching_prefix: bool = True    # P (exact mode): read only the prefix D's digest proves equal
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
        for key, default in (("kvdiag_digest", True), ("kvdiag_pull_matching_prefix", True)):
            value = extra.get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"kv_connector_extra_config.{key} must be true or false")
            flags[key] = value
        role = extra.get("kvdiag_role")
        if role not in (None, "prefill", "decode"):
            raise ValueError('kv_connector_extra_config.kvdiag_role must be "prefill" or "decode"')
        return cls(events_file=events_file or None, sink_capacity=capacity, digest=flags["kvdiag_digest"],
                   pull_matching_prefix=flags["kvdiag_pull_matching_prefix"], role=role)


@dataclass(slots=True)
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


@dataclass(slots=True)
class _Tracked:
    """One request in flight: ids and ints only; strings and events are built at finish."""

    arrival: float                      # time.monotonic(), taken only when events are written
    prefill: PrefillView | None = None
    decode: _DecodeView | None = None
    status: str | None = None           # "ok" / "aborted" / "error", set at finish
    finish_status: Any = None           # vLLM's RequestStatus at finish (rendered only for events)
    completion_tokens: int | None = None


def _status_of(status: Any) -> str:
    if status in _OK_STATUSES:
        return "ok"
    return "aborted" if status == RequestStatus.FINISHED_ABORTED else "error"


class KVDiagNixlConnector(NixlConnector):  # type: ignore[misc]
    """NixlConnector (pull) that observes every request; see the module docstring.

    Cost model (BENCHMARKS.md): the per-step hooks (``update_connector_output``,
    ``get_kv_connector_stats``) return after a few attribute reads when nothing changed; the
    per-request hooks record ids and ints; the report and digest are built once, at finish; events
    are queued as (builder, ids, ints) and built on the sink's thread. Each hook guards its
    observation with a plain try/except (no context manager per call).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any) -> None:
        # Same construction as NixlPullConnector, with the observing worker in the WORKER role.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        self.kvdiag_config = KVDiagConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.kvdiag_guard = Guard("connector")
        self._kvdiag_sink: FieldsEventSink | None = None
        self._kvdiag_stats = KVDiagNixlStats()
        self._stats_dirty = False          # something was counted since the last shipment
        self._tracked: dict[str, _Tracked] = {}
        self._pending: dict[str, _Tracked] = {}
        self._retained: dict[str, tuple[float, int]] = {}   # req_id -> (monotonic since, blocks)
        self._retained_reported = 0
        self._stats_shipped = 0.0
        self._model = str(getattr(vllm_config.model_config, "served_model_name", None) or "") or None
        # NixlConnector fixes these at construction; read once instead of per hook.
        self._bidir = False
        self._threshold = 0
        self._bs = 1
        self._ttl = 0.0
        self._front_aligned = _front_aligned(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
            sched = self.connector_scheduler
            self._bidir = bool(sched.is_bidirectional_kv_xfer_enabled)
            self._threshold = int(sched.kv_recompute_threshold)
            self._bs = int(sched.block_size)
            self._ttl = float(sched.decoder_kv_blocks_ttl)
            if self.kvdiag_config.events_file:
                self._kvdiag_sink = FieldsEventSink(self.kvdiag_config.events_file,
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
        sched = self.connector_scheduler
        attrs = {"pid": os.getpid(), "side_channel_port": int(sched.side_channel_port),
                 "block_size": self._bs, "num_blocks": vllm_config.cache_config.num_gpu_blocks,
                 "bidirectional_kv_xfer": self._bidir,
                 "kv_recompute_threshold": self._threshold,
                 "decoder_kv_blocks_ttl": self._ttl,
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
        try:
            params = request.kv_transfer_params
            if params:   # a plain request (no P/D handle): nothing to observe
                self._track(request, params)
        except Exception as exc:
            self.kvdiag_guard.caught(exc)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        try:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None:
                self._on_matched(tracked, num_computed_tokens, result)
        except Exception as exc:
            self.kvdiag_guard.caught(exc)
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = None
        pulling_from_d = never_posted = False
        try:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None and tracked.prefill is not None and num_external_tokens > 0 and self._bidir:
                # read before vLLM marks the handle processed
                params = request.kv_transfer_params or {}
                if params.get("do_remote_decode") and params.get("remote_block_ids"):
                    pulling_from_d = not params.get("_remote_blocks_processed")
                    # vLLM 0.33 re-matches a processed handle (after a failed or declined read under
                    # kv_load_failure_policy=recompute) but posts no read for it: the request would wait
                    # in WAITING_FOR_REMOTE_KVS forever (docs/connector.md, "A request vLLM never finishes").
                    never_posted = not pulling_from_d and not self.connector_scheduler.use_host_buffer
        except Exception as exc:
            self.kvdiag_guard.caught(exc)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if tracked is None or num_external_tokens <= 0:
            return
        try:
            if tracked.prefill is not None:
                if pulling_from_d:
                    tracked.prefill.read_started(num_external_tokens)
                elif never_posted:
                    self._on_never_posted(request, tracked, num_external_tokens)
            elif tracked.decode is not None:
                tracked.decode.remote_read_tokens = num_external_tokens
        except Exception as exc:
            self.kvdiag_guard.caught(exc)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        out = connector_output
        # Per step: return at once unless the worker reported something or an event is held back.
        if out.kv_connector_stats is None and not out.finished_recving and not out.finished_sending \
                and not getattr(out, "failed_recving", None) and not self._pending:
            return
        try:
            self._on_connector_output(out)
        except Exception as exc:
            self.kvdiag_guard.caught(exc)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return delay, self._observe_finished(request, delay, params)

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._observe_finished(request, delay, params)

    def _observe_finished(self, request: Any, delay: bool,
                          params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Record a finished request (both finish hooks); vLLM's params come back unchanged on any error."""
        try:
            tracked = self._tracked.pop(request.request_id, None)
            if tracked is not None:
                return self._on_finished(request, tracked, delay, params)
        except Exception as exc:
            self.kvdiag_guard.caught(exc)
        return params

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            worker_stats: KVConnectorStats | None = super().get_kv_connector_stats()
            return worker_stats
        # Every step: nothing to ship unless something was counted, retention changed or an error occurred.
        if not self._stats_dirty and len(self._retained) == self._retained_reported and not self.kvdiag_guard.pending:
            return None
        try:
            return self._scheduler_stats()
        except Exception as exc:
            self.kvdiag_guard.caught(exc)
        return None

    def _scheduler_stats(self) -> KVConnectorStats | None:
        # Called every step: a few int compares unless something was counted.
        data = self._kvdiag_stats.data
        if len(self._retained) != self._retained_reported:
            self._retained_reported = len(self._retained)
            data["kvdiag_retained"].append(self._retained_reported)
            self._stats_dirty = True
        if self.kvdiag_guard.pending:
            data["kvdiag_emit_errors"].extend([1] * self.kvdiag_guard.take_unreported())
            self._stats_dirty = True
        if not self._stats_dirty:
            return None
        # Counters ship at most every STATS_INTERVAL_S while requests are in flight (Prometheus needs no
        # per-step granularity; each shipment costs vLLM an aggregate and a payload), at once when idle.
        now = time.monotonic()
        if self._tracked and now - self._stats_shipped < STATS_INTERVAL_S:
            return None
        self._stats_shipped = now
        self._stats_dirty = False
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

    def _count(self, key: str, value: Any) -> None:
        self._kvdiag_stats.data[key].append(value)
        self._stats_dirty = True

    @staticmethod
    def _remember(table: dict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        if len(table) > MAX_TRACKED:   # insertion-ordered: drop the oldest
            del table[next(iter(table))]

    def _track(self, request: Any, params: Any) -> None:
        if not isinstance(params, dict):
            return
        req_id = request.request_id
        arrival = time.monotonic() if self._kvdiag_sink is not None else 0.0
        if params.get("do_remote_decode"):
            has_handle = bool(params.get("remote_block_ids")) and "remote_engine_id" in params \
                and "remote_request_id" in params and "remote_host" in params and "remote_port" in params
            offered = params.get("remote_num_tokens") if has_handle else 0
            view = PrefillView(
                engine_request_id=req_id, prompt_tokens=int(request.num_prompt_tokens), block_size=self._bs,
                has_handle=has_handle, engine_id=self.engine_id,
                remote_engine_id=str(params["remote_engine_id"]) if has_handle else None,
                remote_request_id=str(params["remote_request_id"]) if has_handle else None,
                remote_offered_tokens=offered if isinstance(offered, int) and offered > 0 else 0)
            if has_handle and DIGEST_KEY in params and self._bidir:
                self._check_digest(request, params, view)
            self._remember(self._tracked, req_id, _Tracked(arrival, prefill=view))
        elif params.get("do_remote_prefill"):
            view_d = _DecodeView(engine_request_id=req_id, prompt_tokens=int(request.num_prompt_tokens),
                                 remote_engine_id=_str_or_none(params.get("remote_engine_id")),
                                 remote_request_id=_str_or_none(params.get("remote_request_id")))
            self._remember(self._tracked, req_id, _Tracked(arrival, decode=view_d))

    def _check_digest(self, request: Any, params: dict[str, Any], view: PrefillView) -> None:
        # Token ids stand for the prompt only without embeddings or multimodal inputs (whose
        # placeholders repeat): then the partial last block is left unproven.
        prompt_ids = request.prompt_token_ids if _plain_tokens(request) else None
        try:
            check = check_prefix(params[DIGEST_KEY], request.block_hashes, prompt_ids, self._bs,
                                 view.remote_offered_tokens)
        except DigestError as exc:
            view.attrs["digest_error"] = str(exc)
            return
        view.mismatch_tokens = check.mismatch_tokens
        if check.mismatch_block is not None:
            view.mismatch_block = check.mismatch_block
            view.attrs["matching_blocks"] = check.matched_blocks
        if not self.kvdiag_config.pull_matching_prefix:
            return
        # Exact mode: vLLM reads min(remote_num_tokens, prompt) - local tokens into the blocks it
        # allocates and pairs them with the END of D's block list. Cutting remote_num_tokens to the
        # proven prefix and every group to its first blocks makes that read exactly the proven
        # prefix, position for position (a prompt shorter than D's sequence would otherwise get
        # D's last blocks). A layout whose groups are not position-indexed from the first token
        # (sliding window, Mamba) cannot be cut safely: then a shortfall reads nothing.
        target = check.proven_tokens
        if not self._front_aligned and target < view.remote_offered_tokens:
            target = 0
        need = -(-target // self._bs)
        groups = params["remote_block_ids"]
        cut = self._front_aligned or target == 0
        if target == view.remote_offered_tokens and not (cut and any(len(g) > need for g in groups)):
            return
        params["remote_num_tokens"] = target
        if cut:
            params["remote_block_ids"] = [list(group)[:need] for group in groups]
        view.pull_limit_tokens = target
        view.attrs["pulled_matching_prefix"] = True
        view.attrs["proven_tokens"] = target
        if check.unverified_tokens:
            view.attrs["unverified_tokens"] = check.unverified_tokens

    def _on_matched(self, tracked: _Tracked, num_computed_tokens: int, result: tuple[int | None, bool]) -> None:
        if tracked.decode is not None:
            tracked.decode.local_hit_tokens = num_computed_tokens
            return
        view = tracked.prefill
        if view is None or not view.has_handle:
            return
        view.local_hit_tokens = num_computed_tokens
        threshold = self._threshold
        if not self._bidir or threshold <= 0:
            view.threshold_skipped = False
            return
        remainder = view.remainder_tokens
        skipped = 0 < remainder < threshold and not result[0]
        if skipped and not view.threshold_skipped:
            self._count("kvdiag_threshold_skips", 1)
        view.threshold_skipped = skipped

    def _on_connector_output(self, output: Any) -> None:
        stats = output.kv_connector_stats
        data = stats.data if stats is not None and isinstance(getattr(stats, "data", None), dict) else {}
        rows = data.get("kvdiag_xfers")
        if rows:
            for row in rows:
                self._apply_xfer_row(row)
            data["kvdiag_xfers"] = []  # consumed here; no request ids travel on to the API server
        expired = data.get("kvdiag_expired")
        if expired:
            for row in expired:   # [req_id, P's notifications before expiry] (a bare id from older workers)
                if isinstance(row, list | tuple) and len(row) == 2:
                    self._release(str(row[0]), "expired", int(row[1]))
                else:
                    self._release(str(row), "expired")
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
            if req_id in self._retained:
                self._release(req_id, "read")
        while self._pending:
            req_id = next(iter(self._pending))
            self._emit_final(req_id, self._pending.pop(req_id), None)

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

    def _on_finished(self, request: Any, tracked: _Tracked, delay: bool,
                     params: dict[str, Any] | None) -> dict[str, Any] | None:
        req_status = request.status
        tracked.status = status = _status_of(req_status)
        tracked.finish_status = req_status
        tracked.completion_tokens = int(request.num_output_tokens)
        view = tracked.prefill
        if view is not None:
            failed = status != "ok"
            view.request_failed = failed
            view.failed_reason = f"request finished {req_status}" if failed else None
            if failed and view.pull_started and not view.read_ok and view.failure_type is None:
                # vLLM fails a request whose load failed before it hands the connector the worker's
                # report of that step (update_connector_output runs later in the same step).
                self._remember(self._pending, request.request_id, tracked)
                return params
        elif delay and params is not None and params.get("do_remote_decode"):
            self._on_retained(request, params)
        return self._emit_final(request.request_id, tracked, params)

    def _on_never_posted(self, request: Any, tracked: _Tracked, tokens: int) -> None:
        """Report now a P request vLLM parked for a read it will never post: it never finishes."""
        view = tracked.prefill
        assert view is not None
        req_id = request.request_id
        self._tracked.pop(req_id, None)
        cause = f"its D->P read failed ({view.failure_type})" if view.failure_type else "its D->P read failed"
        _vllm_logger.warning(
            "kvdiag: request %s re-matched %d remote tokens after %s, but vLLM posts no second read for the "
            "same handle: it stays in WAITING_FOR_REMOTE_KVS until aborted (bidirectional_kv_xfer with "
            "kv_load_failure_policy=recompute).", req_id, tokens, cause)
        view.request_failed = True
        view.failed_reason = "stuck in WAITING_FOR_REMOTE_KVS: vLLM posts no second read"
        view.attrs["stuck_waiting_for_remote_kvs"] = True
        view.attrs["rematched_tokens"] = tokens
        tracked.status = "hung"
        tracked.finish_status = RequestStatus.WAITING_FOR_REMOTE_KVS   # where the scheduler parks it next
        tracked.completion_tokens = int(request.num_output_tokens)
        self._emit_final(req_id, tracked, None)

    def _on_retained(self, request: Any, params: dict[str, Any]) -> None:
        blocks = sum(len(group) for group in params.get("remote_block_ids") or ())
        if self.kvdiag_config.digest:
            # Only the checkpoint hashes are read (no copy of the hash list): once per retained request.
            held_tokens = int(params.get("remote_num_tokens") or 0)
            held = held_tokens // self._bs
            tail = request.all_token_ids[held * self._bs:held_tokens] if _plain_tokens(request) else None
            params[DIGEST_KEY] = make_digest(request.block_hashes, self._bs, held, tail)
        self._remember(self._retained, request.request_id, (time.monotonic(), blocks))
        if self._kvdiag_sink is not None:
            self._kvdiag_sink.emit_call(self._retained_fields, request.request_id, blocks,
                                        params.get("remote_num_tokens"), time.time())

    def _release(self, req_id: str, reason: str, notifications: int | None = None) -> None:
        """D gave up a retained sequence: ``read`` when P's notification arrived (a READ, or P's
        notify-only after a skip, which D's NIXL cannot tell apart), ``expired`` when vLLM's lease
        reaper released it (``notifications`` == 0: it was never read)."""
        held = self._retained.pop(req_id, None)
        if held is None:
            return
        self._count("kvdiag_released", reason)
        if self._kvdiag_sink is not None:
            since, blocks = held
            self._kvdiag_sink.emit_call(self._released_fields, req_id, blocks, reason, notifications,
                                        time.monotonic() - since, time.time())

    def _emit_final(self, req_id: str, tracked: _Tracked, params: dict[str, Any] | None) -> dict[str, Any] | None:
        view = tracked.prefill
        if view is not None:
            report = view.report_dict(bidirectional=self._bidir, threshold=self._threshold)
            if params is not None:
                params[REPORT_KEY] = report   # PrefillReport.to_dict()'s shape, without the dataclass
            self._count("kvdiag_requests", ("prefill", report["outcome"]))
            if report["remote_read_tokens"]:
                self._count("kvdiag_read_tokens", report["remote_read_tokens"])
            if view.mismatch_tokens:
                self._count("kvdiag_mismatch_tokens", view.mismatch_tokens)
            if self._kvdiag_sink is not None:
                self._kvdiag_sink.emit_call(self._prefill_fields, req_id, tracked, view, report,
                                            time.monotonic() - tracked.arrival, time.time())
        elif tracked.decode is not None:
            self._count("kvdiag_requests", _DECODE_ROW)
            if self._kvdiag_sink is not None:
                self._kvdiag_sink.emit_call(self._decode_fields, req_id, tracked, tracked.decode, bool(params),
                                            time.monotonic() - tracked.arrival, time.time())
        return params

    # --- events -----------------------------------------------------------------------------------
    # The hooks queue (builder, ids, ints, the finished request's own records, clock readings); the
    # builders below run on the sink's writer thread. What they read is no longer changed once
    # queued: the request has left _tracked / _retained, and the report dict is only read.

    def _retained_fields(self, req_id: str, blocks: int, remote_num_tokens: Any, wall: float) -> dict[str, Any]:
        return {"ts": round(wall, 3), "source": "decode", "event": "kv_retained", "engine_id": self.engine_id,
                "engine_request_id": req_id, "request_id": header_request_id(req_id), "model": self._model,
                "retained_blocks": blocks, "ttl_s": self._ttl, "expiry_ts": round(wall + self._ttl, 3),
                "attrs": {"remote_num_tokens": remote_num_tokens}}

    def _released_fields(self, req_id: str, blocks: int, reason: str, notifications: int | None, held_s: float,
                         wall: float) -> dict[str, Any]:
        attrs: dict[str, Any] = {"held_s": round(held_s, 3)}
        if reason == "read":
            attrs["notified"] = True
        elif notifications is not None:
            attrs["notifications"] = notifications
            attrs["unread"] = notifications == 0
        return {"ts": round(wall, 3), "source": "decode", "event": "kv_released", "engine_id": self.engine_id,
                "engine_request_id": req_id, "request_id": header_request_id(req_id), "model": self._model,
                "retained_blocks": blocks, "ttl_s": self._ttl, "release_reason": reason, "attrs": attrs}

    @staticmethod
    def _finish_attrs(tracked: _Tracked) -> dict[str, Any]:
        reason = RequestStatus.get_finished_reason(tracked.finish_status)
        return {"finish_status": str(tracked.finish_status),
                "finish_reason": str(reason) if reason is not None else None,
                "role": "P" if tracked.prefill is not None else "D"}

    def _prefill_fields(self, req_id: str, tracked: _Tracked, view: PrefillView, report: dict[str, Any],
                        elapsed_s: float, wall: float) -> dict[str, Any]:
        attrs = {**view.attrs, **self._finish_attrs(tracked)}
        if view.threshold_skipped:
            attrs["threshold_skipped"] = True
        return {
            "ts": round(wall, 3), "source": "prefill", "event": "prefill_request", "engine_id": self.engine_id,
            "engine_request_id": req_id, "request_id": header_request_id(req_id), "model": self._model,
            "prompt_tokens": report["prompt_tokens"], "completion_tokens": tracked.completion_tokens,
            "local_hit_tokens": report["local_hit_tokens"], "remote_offered_tokens": report["remote_offered_tokens"],
            "remote_read_tokens": report["remote_read_tokens"], "computed_tokens": report["computed_tokens"],
            "transfer_bytes": report["transfer_bytes"], "transfer_ms": report["transfer_ms"],
            "duration_ms": round(elapsed_s * 1000.0, 3),
            "remote_engine_id": report.get("remote_engine_id"), "remote_request_id": report.get("remote_request_id"),
            "outcome": report["outcome"], "reason": report.get("reason"), "failure_type": report.get("failure_type"),
            "mismatch_tokens": view.mismatch_tokens, "status": tracked.status, "attrs": attrs}

    def _decode_fields(self, req_id: str, tracked: _Tracked, d: _DecodeView, returned_handle: bool,
                       elapsed_s: float, wall: float) -> dict[str, Any]:
        read = d.remote_read_tokens if d.read_ok else 0
        return {
            "ts": round(wall, 3), "source": "decode", "event": "decode_request", "engine_id": self.engine_id,
            "engine_request_id": req_id, "request_id": header_request_id(req_id), "model": self._model,
            "prompt_tokens": d.prompt_tokens, "completion_tokens": tracked.completion_tokens,
            "local_hit_tokens": d.local_hit_tokens, "remote_read_tokens": read,
            "computed_tokens": max(d.prompt_tokens - d.local_hit_tokens - read, 0),
            "transfer_bytes": d.transfer_bytes, "transfer_ms": round(d.transfer_ms, 3),
            "duration_ms": round(elapsed_s * 1000.0, 3),
            "remote_engine_id": d.remote_engine_id, "remote_request_id": d.remote_request_id,
            "failure_type": d.failure_type, "status": tracked.status,
            "attrs": {**self._finish_attrs(tracked), "returned_handle": returned_handle}}

    def _emit(self, **fields: Any) -> None:
        if self._kvdiag_sink is not None:
            fields["ts"] = now_ts()
            self._kvdiag_sink.emit_fields(fields)

    def _count_sink_error(self) -> None:
        # Runs on the sink's thread: only bump counters; get_kv_connector_stats reports them.
        self.kvdiag_guard.count()

    def kvdiag_flush(self) -> None:
        """Write out every queued event (tests, shutdown)."""
        if self._kvdiag_sink is not None:
            self._kvdiag_sink.flush()


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _plain_tokens(request: Any) -> bool:
    """True when the request's token ids alone say what its KV covers (no embeddings, no images)."""
    return getattr(request, "prompt_embeds", None) is None and not getattr(request, "mm_features", None)


def _front_aligned(kv_cache_config: Any) -> bool:
    """True when every KV cache group holds one block per block_size tokens from the first token,
    so the first N block ids of D's list are positions 0..N*block_size-1 (full attention, MLA)."""
    groups: list[Any] = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    return bool(groups) and all(type(g.kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec) for g in groups)
