"""The NIXL pull worker with per-request observation (imports vLLM).

Each override calls vLLM's method unchanged and only records what happened; a failure of the
recording is caught, counted and logged (``Guard``), never raised into the engine.

What it records, per request, into the stats vLLM already sends to the scheduler
(kvdiag.instrumentation.stats): NIXL's telemetry (bytes, transfer duration) of each READ it
polled done, the failure type of a failed read (vLLM's ``NIXL transfer failure: <type>``), a
read declined as expiring, and D-side leases released at expiry.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from kvdiag.instrumentation.guard import Guard
from kvdiag.instrumentation.stats import KVDiagNixlStats
from kvdiag.schema.prefill_outcome import DECLINED_EXPIRED

_logger = logging.getLogger(__name__)

_MAX_TRACKED = 65_536  # bound on requests with partial records (a leak would grow them forever)


class ObservedPullWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """NixlPullConnectorWorker that reports per-request transfer facts through its stats."""

    def __init__(self, *args: Any, guard: Guard | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvdiag_guard = guard or Guard("worker")
        self.xfer_stats = KVDiagNixlStats()
        # req_id -> [bytes, seconds] accumulated over the request's READ handles
        self._kvdiag_done: dict[str, list[float]] = {}
        self._kvdiag_failure: dict[str, str] = {}
        self._kvdiag_reading: str | None = None

    # --- observation points -------------------------------------------------------------------

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> Any:
        self._kvdiag_reading = req_id
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            self._kvdiag_reading = None

    def _is_turn2_read_expired(self, meta: Any) -> bool:
        expired = bool(super()._is_turn2_read_expired(meta))
        if expired:
            with self.kvdiag_guard:
                if self._kvdiag_reading is not None and len(self._kvdiag_failure) < _MAX_TRACKED:
                    self._kvdiag_failure[self._kvdiag_reading] = DECLINED_EXPIRED
        return expired

    def _log_failure(self, failure_type: str, req_id: str | None, *args: Any, **kwargs: Any) -> None:
        super()._log_failure(failure_type, req_id, *args, **kwargs)
        with self.kvdiag_guard:
            if req_id is not None and len(self._kvdiag_failure) < _MAX_TRACKED:
                self._kvdiag_failure.setdefault(req_id, failure_type)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        # vLLM polls every request's handles in one loop and records NIXL telemetry per handle into
        # xfer_stats. Polling one request at a time (same order, same calls) lets the telemetry
        # appended during each call be attributed to that request.
        done: set[str] = set()
        failed: set[str] = set()
        for req_id in list(transfers):
            single = {req_id: transfers[req_id]}
            before = self._kvdiag_stats_len()
            d, f = super()._pop_done_transfers(single)
            done |= d
            failed |= f
            if req_id in single:
                transfers[req_id] = single[req_id]
            else:
                del transfers[req_id]
            with self.kvdiag_guard:
                self._kvdiag_attribute(req_id, before)
        return done, failed

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        if not self._reqs_to_send:   # every step: nothing held, nothing can expire
            super()._reap_expired_send_leases(done_sending)
            return
        before = set(done_sending)
        # vLLM pops the per-request count of consumer notifications as it reaps ("... retrieved by %d
        # remote worker(s) before lease expired"): read them first. 0 means the blocks expired unread.
        notified = dict(self.consumer_notification_counts_by_req)
        super()._reap_expired_send_leases(done_sending)
        with self.kvdiag_guard:
            self.xfer_stats.data["kvdiag_expired"].extend(
                [req_id, int(notified.get(req_id, 0))] for req_id in sorted(done_sending - before))

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        with self.kvdiag_guard:
            self._kvdiag_rows(set(results.finished_recving or ()), set(results.failed_recving or ()))
        return results

    # --- bookkeeping --------------------------------------------------------------------------

    def _kvdiag_stats_len(self) -> int:
        return len(self.xfer_stats.data["bytes_transferred"])

    def _kvdiag_attribute(self, req_id: str, before: int) -> None:
        data = self.xfer_stats.data
        new_bytes = data["bytes_transferred"][before:]
        new_secs = data["transfer_duration"][before:]
        if not new_bytes:
            return
        acc = self._kvdiag_done.setdefault(req_id, [0.0, 0.0])
        acc[0] += float(sum(new_bytes))
        acc[1] += float(sum(new_secs))
        if len(self._kvdiag_done) > _MAX_TRACKED:
            self._kvdiag_done.pop(next(iter(self._kvdiag_done)))

    def _kvdiag_rows(self, finished: set[str], failed: set[str]) -> None:
        rows = self.xfer_stats.data["kvdiag_xfers"]
        for req_id in sorted(finished | failed):
            nbytes, secs = self._kvdiag_done.pop(req_id, [0.0, 0.0])
            failure = self._kvdiag_failure.pop(req_id, "unknown" if req_id in failed else "")
            if req_id not in failed:
                failure = ""
            rows.append([req_id, int(nbytes), secs, failure])
