"""One emulated vLLM engine: request roles, prefix cache, D->P / P->D pulls, retention, policies, logs.

Role by params, as vLLM: ``do_remote_decode`` -> this request runs as P (prefill, blocks held for
D under ``kv_lease_duration``; a handle from D's previous turn is pulled first); ``do_remote_prefill``
-> runs as D (pulls P's blocks, decodes, and with bidirectional on holds the finished request's
blocks for ``decoder_kv_blocks_ttl`` and returns their location). The HTTP layer (server.py) calls
:meth:`Engine.prefill`, iterates :meth:`Engine.generate`, then calls :meth:`Engine.finish`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvdiag.exporters.jsonl import EventSink
from kvdiag.schema.events import PrefillReport, TurnEvent, now_ts
from kvdiag.schema.prefill_outcome import PrefillView
from kvdiag.schema.prefix_digest import DIGEST_KEY, make_digest
from kvdiag.schema.request_ids import MAX_HEADER_ID, vllm_request_ids
from kvdiag.schema.verdicts import Verdict
from kvdiag.sim import vllm_log_writer as vl
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.engine_metrics import VllmMetrics
from kvdiag.sim.faults import Faults
from kvdiag.sim.kvcache import BlockPool, Hold, OutOfBlocks, blocks_for, chain_hashes
from kvdiag.sim.model_output import OutputPlan, generate
from kvdiag.sim.nixl import NixlClient, RemoteAgent
from kvdiag.sim.remote_read import ReadResult, has_handle, pull
from kvdiag.sim.stat_log_writer import StatsLogger
from kvdiag.sim.timemodel import get_profile

_logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The request failed for a reason unrelated to KV reuse (HTTP 500)."""


class KVLoadFailed(Exception):
    """A declined or failed KV read under ``kv_load_failure_policy=fail`` (finish_reason error)."""


@dataclass
class RequestState:
    """One request inside the engine."""

    request_id: str | None  # the X-Request-Id header
    external_id: str
    internal_id: str
    prompt: list[int]
    max_tokens: int
    params: dict[str, Any] | None
    seed: int = 0
    role: str = "plain"  # "P", "D" or "plain"
    plan: OutputPlan = field(default_factory=OutputPlan)
    hit_tokens: int = 0
    block_hashes: list[str] = field(default_factory=list)  # the prompt's chained full-block hashes
    kv: list[int] = field(default_factory=list)  # the token ids this request's KV was computed for, per position
    local_wrong_kv: int = 0  # prefix-cache hits whose blocks hold KV of other ids (loaded wrong earlier)
    block_ids: list[int] = field(default_factory=list)
    read: ReadResult = field(default_factory=ReadResult)
    computed_tokens: int = 0
    output: list[int] = field(default_factory=list)
    planned: list[int] = field(default_factory=list)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    prefill_ms: float = 0.0
    status: str = "ok"
    finish_reason: str | None = None
    error: str | None = None
    kv_failed: bool = False
    emitted: bool = False
    model_ms: float = 0.0  # modelled time spent so far; sleeps end at t_arrival + model_ms x time_scale
    disconnected: Callable[[], bool] | None = None  # set by the HTTP layer

    @property
    def cached_tokens(self) -> int:
        """usage.prompt_tokens_details.cached_tokens: local hit + tokens pulled from a remote engine."""
        return self.hit_tokens + self.read.read_tokens

    @property
    def wrong_kv_tokens(self) -> int:
        """Prompt positions whose KV, loaded from a remote engine or the prefix cache, belongs to other ids."""
        return self.local_wrong_kv + self.read.wrong_kv_tokens


class Engine:
    """State and behaviour of one engine; the NIXL side channel calls the ``nixl_*`` methods."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.engine_id = config.engine_id or str(uuid.uuid4())
        self.profile = get_profile(config.profile)
        self.faults = Faults(bidirectional_kv_xfer=config.bidirectional_kv_xfer,
                             stream_kv_params=config.stream_kv_params, prefix_caching=config.prefix_caching,
                             kv_load_failure_policy=config.kv_load_failure_policy,
                             hang_on_recompute=config.hang_on_recompute, kv_recompute_threshold=config.threshold,
                             fail_transfers=dict(config.fail_transfers), fail_requests=config.fail_requests,
                             pull_matching_prefix=config.pull_matching_prefix, seed=config.seed)
        self.pool = BlockPool(config.num_blocks, config.block_size, config.prefix_caching)
        self.log = vl.VllmLogWriter(config.log_file, config.log_level, self.pid)
        self.metrics = VllmMetrics(config.model, config.instrumented)
        self.sink = EventSink(config.events_file, on_error=self._count_emit_error) if (
            config.events_file and config.instrumented) else None
        self.nixl = NixlClient(self.engine_id)
        self.stats = StatsLogger(self)
        self.running = 0
        self.waiting = 0
        self.wrong_kv_tokens = 0  # the oracle, white-box: every wrongly loaded prompt position so far
        self.side_channel_port = 0
        self._closing = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------------
    def announce(self) -> None:
        """Startup lines and the engine_start event (called once the ports are known)."""
        self.log.log("INFO", "connector_created", vl.MSG_CONNECTOR_CREATED, "NixlConnector", self.engine_id)
        self.log.log("INFO", "init_scheduler", vl.MSG_INIT_SCHEDULER, self.engine_id)
        if self.faults.bidirectional_kv_xfer and self.faults.kv_recompute_threshold > 0:
            self.log.log("INFO", "startup_bidir", vl.MSG_STARTUP_BIDIR, self.faults.kv_recompute_threshold,
                         int(self.config.decoder_kv_blocks_ttl))
        self.emit("engine_start", attrs={
            "pid": self.pid, "side_channel_port": self.side_channel_port, "profile": self.profile.name,
            "block_size": self.config.block_size, "num_blocks": self.config.num_blocks,
            "bidirectional_kv_xfer": self.faults.bidirectional_kv_xfer,
            "kv_recompute_threshold": self.faults.kv_recompute_threshold,
            "decoder_kv_blocks_ttl": self.config.decoder_kv_blocks_ttl,
            "prefix_caching": self.faults.prefix_caching,
            "kv_load_failure_policy": self.faults.kv_load_failure_policy})

    async def run_background(self) -> None:
        """Reap expired holds and write the periodic stat lines until closed."""
        while not self._closing.is_set():
            self.reap()
            self.stats.maybe_log()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), timeout=0.05)

    async def close(self) -> None:
        """Stop background work, close the NIXL client, flush logs and events."""
        self._closing.set()
        await self.nixl.close()
        if self.sink is not None:
            self.sink.close()
        self.log.close()

    def restart(self) -> str:
        """Emulate an engine restart: new engine id, every block and hold gone."""
        for hold in list(self.pool.holds.values()):
            if hold.kind == "ttl":
                self.emit("kv_released", request_id=hold.attrs.get("request_id"), engine_request_id=hold.request_id,
                          retained_blocks=len(hold.block_ids), release_reason="restart")
        self.pool.clear()
        self.nixl.forget()
        self.engine_id = str(uuid.uuid4())
        self.nixl.local_engine_id = self.engine_id
        self.announce()
        return self.engine_id

    def evict_retained(self, limit: int | None = None) -> int:
        """Memory pressure: release D's retained blocks early (oldest first); return how many requests."""
        done = 0
        while limit is None or done < limit:
            hold = self.pool.oldest_hold("ttl")
            if hold is None:
                break
            self.pool.take_hold(hold.request_id)
            self._released(hold, "evicted")
            done += 1
        return done

    # --- counters used by remote_read and stats -----------------------------------------------
    def count_threshold_skip(self) -> None:
        """A pull skipped by kv_recompute_threshold."""
        series = self.metrics.connector("kvdiag_connector_threshold_skips")
        if series is not None:
            series.inc()

    def count_failed_transfer(self, notification: bool = False) -> None:
        """A failed transfer, handshake or notification (vLLM 0.33 counts all three as failed transfers)."""
        if notification:
            self.metrics.nixl_num_failed_notifications.inc()
        self.metrics.nixl_num_failed_transfers.inc()
        self.stats.failed_transfers += 1

    def count_expired(self) -> None:
        """A request whose KV expired (declined on P, released at TTL on D); not a failed transfer."""
        self.metrics.nixl_num_kv_expired_reqs.inc()
        self.stats.expired_reqs += 1

    def count_notification_after_expiry(self) -> None:
        """A reader's notification for blocks this engine no longer holds (their KV may have been reused)."""
        self.metrics.nixl_num_notifications_after_expiry.inc()
        self.stats.notifs_after_expiry += 1

    def record_transfer(self, model_ms: float, post_s: float, nbytes: int, descriptors: int) -> None:
        """A completed read (telemetry is recorded by the reader, as in vLLM)."""
        self.metrics.nixl_xfer_time.observe(model_ms / 1000.0)
        self.metrics.nixl_post_time.observe(post_s)
        self.metrics.nixl_bytes_transferred.observe(nbytes)
        self.metrics.nixl_num_descriptors.observe(descriptors)
        self.stats.transfers.append((model_ms, post_s * 1000.0, nbytes, descriptors))

    def _count_wrong_kv(self, state: RequestState) -> None:
        """The oracle's counters: every prompt position whose loaded KV belongs to other token ids."""
        remote, local = state.read.wrong_kv_tokens, state.local_wrong_kv
        self.wrong_kv_tokens += remote + local
        if remote:
            self.metrics.wrong_kv_tokens["remote_read"].inc(remote)
        if local:
            self.metrics.wrong_kv_tokens["local_hit"].inc(local)
        mismatch = state.read.mismatch_tokens
        series = self.metrics.connector("kvdiag_connector_mismatch_tokens") if mismatch else None
        if series is not None:
            series.inc(mismatch)

    def note_handshake(self, agent: RemoteAgent) -> None:
        """First successful handshake with a peer logs vLLM's compatibility line."""
        if agent.engine_id not in self.stats.handshaken:
            self.stats.handshaken.add(agent.engine_id)
            if len(self.stats.handshaken) > 1024:
                self.stats.handshaken.clear()
            self.log.log("INFO", "compat_ok", vl.MSG_COMPAT_OK, "96e517f363b03b2d90e924e04129822ae05c7b0064ea51912a"
                         "1c0d4b16")
            # vLLM's worker registers the peer right after the check and logs its plan (one TP rank each side).
            self.log.log("INFO", "transfer_plan", vl.MSG_TRANSFER_PLAN, 1, 8, 1, 1, 0, 1, 1, 0,
                         self.config.block_size * 8 * 128 * 2 * 2)

    def _count_emit_error(self) -> None:
        if self.metrics.catalog is not None:
            self.metrics.catalog.labels("kvdiag_emit_errors", component="connector").inc()

    # --- request path -------------------------------------------------------------------------
    def new_request(self, request_id: str | None, kind: str, prompt: list[int], max_tokens: int,
                    params: dict[str, Any] | None, seed: int = 0, arrival: float | None = None,
                    plan: OutputPlan | None = None) -> RequestState:
        """Assign vLLM's ids: external ``chatcmpl-<X-Request-Id>``, internal ``<external>-<8 hex>``."""
        request_id = request_id[:MAX_HEADER_ID] if request_id else None  # client-supplied: bound what reaches logs
        external, internal = vllm_request_ids(request_id, kind)
        role = "plain"
        if isinstance(params, dict):
            role = "P" if params.get("do_remote_decode") else ("D" if params.get("do_remote_prefill") else "plain")
            if role == "P":
                max_tokens = 1
        state = RequestState(request_id, external, internal, prompt, max_tokens, params, seed, role,
                             plan or OutputPlan())
        if arrival is not None:
            state.t_arrival = arrival
        return state

    async def prefill(self, state: RequestState) -> None:
        """Match the prefix, pull remote KV, compute the rest; raise RequestFailed or KVLoadFailed."""
        self.waiting += 1
        try:
            if self.faults.request_fails():
                state.status, state.error = "error", "injected failure (--fail-requests)"
                raise RequestFailed(state.error)
            await self._prefill(state)
        finally:
            self.waiting -= 1

    async def _prefill(self, state: RequestState) -> None:
        bs = self.config.block_size
        self.pool.prefix_caching = self.faults.prefix_caching
        hashes = state.block_hashes = chain_hashes(state.prompt, bs)
        hit_blocks = self.pool.match(hashes[:(len(state.prompt) - 1) // bs])
        self.pool.acquire(hit_blocks)
        state.block_ids = list(hit_blocks)
        state.hit_tokens = len(hit_blocks) * bs
        state.kv = list(state.prompt)
        for i, block in enumerate(hit_blocks):
            held = self.pool.content(block)
            state.kv[i * bs:i * bs + len(held)] = held
        state.local_wrong_kv = sum(a != b for a, b in zip(state.kv[:state.hit_tokens], state.prompt, strict=False))
        self.metrics.prefix_cache_queries.inc(len(state.prompt))
        self.metrics.prefix_cache_hits.inc(state.hit_tokens)
        if self.faults.prefix_caching:
            self.stats.local.observe(len(state.prompt), state.hit_tokens)
        params = state.params or {}
        if state.role == "P" and has_handle(params):
            if self.faults.bidirectional_kv_xfer:
                await self._pull(state, params, d2p=True)
            elif isinstance(params.get("remote_num_tokens"), int):
                state.read.remote_num_tokens = max(0, params["remote_num_tokens"])  # P ignores the handle
        elif state.role == "D" and has_handle(params):
            await self._pull(state, params, d2p=False)
        # vLLM's connector lookup: the tokens past the local hit, and those the remote read supplied
        self.stats.external.observe(len(state.prompt) - state.hit_tokens, state.read.read_tokens)
        state.computed_tokens = len(state.prompt) - state.hit_tokens - state.read.read_tokens
        ctx = state.hit_tokens + state.read.read_tokens
        await self.advance(state, self.profile.prefill_ms(state.computed_tokens, ctx))
        state.prefill_ms = (time.perf_counter() - state.t_arrival) * 1000.0
        self._allocate(state, len(state.prompt))
        self.pool.write(state.block_ids[len(hit_blocks):], state.kv, first_block=len(hit_blocks))
        self.pool.commit(state.block_ids, hashes)
        self._count_wrong_kv(state)
        m = self.metrics
        m.prompt_tokens.inc(len(state.prompt))
        m.prompt_tokens_by_source["local_compute"].inc(state.computed_tokens)
        m.prompt_tokens_by_source["local_cache_hit"].inc(state.hit_tokens)
        m.prompt_tokens_by_source["external_kv_transfer"].inc(state.read.read_tokens)
        m.prompt_tokens_cached.inc(state.cached_tokens)
        m.request_prefill_kv_computed_tokens.observe(state.computed_tokens)
        m.request_prefill_time.observe(state.prefill_ms / 1000.0)
        self.stats.prompt_tokens += state.computed_tokens  # vLLM's prompt throughput: computed tokens only

    async def _pull(self, state: RequestState, params: dict[str, Any], d2p: bool) -> None:
        res = await pull(self, state, params, d2p=d2p)
        state.read = res
        if res.read_tokens:
            self.metrics.external_prefix_cache_queries.inc(res.offered)
            self.metrics.external_prefix_cache_hits.inc(res.read_tokens)
            series = self.metrics.connector("kvdiag_connector_remote_read_tokens")
            if series is not None:
                series.inc(res.read_tokens)
        if not res.failed:
            return
        self.log.log("WARNING", "skip_post", vl.MSG_SKIP_POST, state.internal_id)
        if self.faults.kv_load_failure_policy == "fail":
            self.log.log("ERROR", "failing", vl.MSG_FAILING, 1, res.affected_tokens, {state.internal_id})
            state.kv_failed = True
            state.status, state.error = "error", res.reason
            raise KVLoadFailed(res.reason or "KV load failed")
        if self.faults.hang_on_recompute:
            await self._hang(state, res)
        self.log.log("WARNING", "recovered", vl.MSG_RECOVERED, 1, res.affected_tokens)
        res.reason = f"{res.reason}; recomputed (kv_load_failure_policy=recompute)"
        self.metrics.prompt_tokens_recomputed.inc(res.affected_tokens)

    async def _hang(self, state: RequestState, res: ReadResult) -> None:
        """vLLM 0.33 with policy recompute: the request sits in WAITING_FOR_REMOTE_KVS forever (finding F1)."""
        state.status = "hung"
        self.emit_request(state)  # the only record of a request that never finishes
        self.waiting += 1
        try:
            while not self._closing.is_set():
                if state.disconnected is not None and state.disconnected():
                    raise RequestFailed("client disconnected while the request hung in WAITING_FOR_REMOTE_KVS")
                if self.log.enabled("DEBUG"):
                    shown = dict(state.params or {})
                    shown["_remote_blocks_processed"] = True
                    self.log.log("DEBUG", "update_state_after_alloc", vl.MSG_UPDATE_STATE, res.affected_tokens,
                                 shown)
                    self.log.log("DEBUG", "still_waiting", vl.MSG_STILL_WAITING, state.internal_id)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), timeout=0.2)
        finally:
            self.waiting -= 1
        raise RequestFailed("engine shut down while the request hung in WAITING_FOR_REMOTE_KVS")

    async def advance(self, state: RequestState, ms: float) -> None:
        """Spend ``ms`` modelled milliseconds: sleep until the request's modelled clock (scaled) catches up.

        Measuring from arrival absorbs the sim's own CPU time (tokenizing, hashing, HTTP), so the
        observed latency follows the time model rather than model + overhead.
        """
        state.model_ms += ms
        scale = self.config.time_scale
        if scale <= 0:
            return
        delay = state.t_arrival + state.model_ms * scale / 1000.0 - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    def _allocate(self, state: RequestState, num_tokens: int) -> None:
        need = blocks_for(num_tokens, self.config.block_size) - len(state.block_ids)
        if need <= 0:
            return
        while True:
            try:
                state.block_ids.extend(self.pool.allocate(need))
                return
            except OutOfBlocks:
                if self.evict_retained(limit=1) == 0:
                    state.status, state.error = "error", "out of KV blocks"
                    raise RequestFailed("out of KV cache blocks; raise --num-blocks") from None

    async def generate(self, state: RequestState) -> Any:
        """Yield output token ids, sleeping one modelled decode step per token (``state.planned`` holds them all)."""
        self.running += 1
        try:
            tokens, finish = generate(self.config.seed + state.seed, state.prompt, state.max_tokens, state.plan)
            state.planned = tokens
            for i, tok in enumerate(tokens):
                if i > 0 or state.role != "P":  # P's single token comes out of its prefill step
                    await self.advance(state, self.profile.decode_step_ms)
                state.output.append(tok)
                if state.t_first_token is None:
                    state.t_first_token = time.perf_counter()
                    self.metrics.time_to_first_token.observe(state.t_first_token - state.t_arrival)
                self.stats.generation_tokens += 1
                self.metrics.generation_tokens.inc()
                if i == len(tokens) - 1:
                    state.finish_reason = finish
                yield tok
        finally:
            self.running -= 1

    def finish(self, state: RequestState, aborted: bool = False) -> dict[str, Any] | None:
        """Free or hold the request's blocks; return the kv_transfer_params of the response (or None)."""
        now = time.perf_counter()
        self.metrics.e2e_request_latency.observe(now - state.t_arrival)
        if state.t_first_token is not None:
            self.metrics.request_decode_time.observe(now - state.t_first_token)
        if aborted:
            state.status, state.finish_reason = "aborted", "abort"
        if state.status == "error" and state.finish_reason is None:
            state.finish_reason = "error"
        self.metrics.request_success[state.finish_reason or "error"].inc()
        params: dict[str, Any] | None = None
        bs = self.config.block_size
        ok = state.status == "ok" and state.finish_reason in ("length", "stop")
        if ok and state.role == "P":
            params = self._hold_and_params(state, len(state.prompt), "lease", self.config.kv_lease_duration)
            params["remote_prefill_cached_tokens"] = state.cached_tokens
        elif ok and state.role == "D" and self.faults.bidirectional_kv_xfer:
            num = len(state.prompt) + len(state.output) - 1
            params = self._hold_and_params(state, num, "ttl", self.config.decoder_kv_blocks_ttl)
        else:
            if state.status == "ok" and state.output:
                seq = state.prompt + state.output[:-1]
                with contextlib.suppress(RequestFailed):
                    self._allocate(state, len(seq))
                self.pool.write(state.block_ids, [*state.kv, *state.output[:-1]])
                self.pool.commit(state.block_ids, chain_hashes(seq, bs))
            self.pool.release(state.block_ids)
            state.block_ids = []
        if state.role == "P" and self.config.instrumented and params is not None:
            # Only into params vLLM returns: a stock proxy branches on null params, so null stays null
            # (the outcome still reaches the prefill event, the metrics and a failed request's error body).
            params = {**params, "kvdiag": self.report(state).to_dict()}
        self.emit_request(state)
        return params

    def _hold_and_params(self, state: RequestState, num_tokens: int, kind: str, ttl: float) -> dict[str, Any]:
        bs = self.config.block_size
        seq = (state.prompt + state.output)[:num_tokens]
        with contextlib.suppress(RequestFailed):
            self._allocate(state, num_tokens)
        hashes = chain_hashes(seq, bs)
        self.pool.write(state.block_ids, [*state.kv, *state.output][:num_tokens])
        self.pool.commit(state.block_ids, hashes)
        deadline = time.perf_counter() + ttl
        blocks = state.block_ids[:blocks_for(num_tokens, bs)]
        spare = state.block_ids[len(blocks):]
        self.pool.release(spare)
        state.block_ids = blocks
        hold = Hold(state.internal_id, blocks, num_tokens, deadline, ttl, hashes, kind, created=time.time(),
                    attrs={"request_id": state.request_id} if state.request_id else {})
        self.pool.hold(hold)
        self.log.log("DEBUG", "request_finished_wait", vl.MSG_REQUEST_FINISHED_WAIT, state.internal_id, int(ttl))
        if kind == "ttl":
            self.emit("kv_retained", request_id=state.request_id, engine_request_id=state.internal_id,
                      retained_blocks=len(blocks), expiry_ts=round(time.time() + ttl, 3), ttl_s=float(ttl))
            series = self.metrics.connector("kvdiag_connector_retained_requests")
            if series is not None:
                series.set(sum(1 for h in self.pool.holds.values() if h.kind == "ttl"))
        is_p = kind == "lease"
        params: dict[str, Any] = {
            "do_remote_prefill": is_p, "do_remote_decode": not is_p, "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.engine_id, "remote_request_id": state.internal_id,
            "remote_host": self.config.host, "remote_port": self.side_channel_port, "tp_size": 1, "dcp_size": 1,
            "pp_size": 1, "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": deadline if kind == "ttl" else None,
            "remote_registration_generation": 1, "transfer_mode": "pull"}
        if kind == "ttl" and self.config.instrumented and self.config.prefix_digest:
            # kvdiag's connector on D: a compact digest of the held sequence, for P's exact check.
            full = num_tokens // bs
            params[DIGEST_KEY] = make_digest([bytes.fromhex(h) for h in hashes[:full]], bs, full,
                                             seq[full * bs:num_tokens])
        return params

    # --- retention ------------------------------------------------------------------------------
    def reap(self) -> None:
        """Release holds whose TTL or lease ran out (vLLM's get_finished)."""
        for hold in self.pool.expired_holds(time.perf_counter()):
            self.log.log("WARNING", "releasing_expired", vl.MSG_RELEASING_EXPIRED, hold.request_id, hold.reads)
            self.count_expired()
            if hold.kind == "ttl":
                self._released(hold, "expired")

    def _released(self, hold: Hold, reason: str) -> None:
        if hold.kind != "ttl":
            return
        self.emit("kv_released", request_id=hold.attrs.get("request_id"), engine_request_id=hold.request_id,
                  retained_blocks=len(hold.block_ids), release_reason=reason, ttl_s=float(hold.ttl_s),
                  attrs={"held_s": round(time.time() - hold.created, 3)})
        series = self.metrics.connector("kvdiag_connector_released", reason=reason)
        if series is not None:
            series.inc()
            self.metrics.connector("kvdiag_connector_retained_requests").set(
                sum(1 for h in self.pool.holds.values() if h.kind == "ttl"))

    # --- NIXL side channel (the owner side) ---------------------------------------------------------
    def nixl_handshake(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a reader's handshake with this engine's id and perf_counter clock."""
        return {"engine_id": self.engine_id, "perf_counter": time.perf_counter(), "version": 5}

    def nixl_read(self, body: dict[str, Any]) -> dict[str, Any]:
        """Serve a READ of held blocks; with ``notify`` the blocks are freed (single read)."""
        if body.get("engine_id") != self.engine_id:
            return {"engine_mismatch": True, "engine_id": self.engine_id}
        req_id = str(body.get("remote_request_id"))
        hold = self.pool.holds.get(req_id)
        raw = body.get("block_ids")
        wanted: list[Any] = raw if isinstance(raw, list) else []
        # What the read transfers: the KV of each block, i.e. the token ids it was computed for. A block
        # no longer held still holds whatever was last written into it (stale memory, as real NIXL reads).
        ids = [b for b in wanted if isinstance(b, int) and not isinstance(b, bool) and 0 < b <= self.pool.num_blocks]
        block_tokens = [list(self.pool.content(b)) for b in ids] if len(ids) == len(wanted) else []
        if hold is None or not set(wanted) <= set(hold.block_ids):
            if body.get("notify", True):
                self.log.log("ERROR", "potentially_invalid", vl.MSG_POTENTIALLY_INVALID, req_id)
                self.count_notification_after_expiry()
            return {"held": False, "block_tokens": block_tokens}
        hold.reads += 1
        if body.get("notify", True):
            self._finished_sending(hold, "read")
        return {"held": True, "block_tokens": block_tokens}

    def nixl_notify(self, body: dict[str, Any]) -> dict[str, Any]:
        """Notify-only: the reader skipped the pull; free the blocks now."""
        if body.get("engine_id") != self.engine_id:
            return {"engine_mismatch": True, "engine_id": self.engine_id}
        req_id = str(body.get("remote_request_id"))
        hold = self.pool.holds.get(req_id)
        if hold is None:
            self.log.log("ERROR", "potentially_invalid", vl.MSG_POTENTIALLY_INVALID, req_id)
            self.count_notification_after_expiry()
            return {"held": False}
        self._finished_sending(hold, "notify_only")
        return {"held": True}

    def _finished_sending(self, hold: Hold, reason: str) -> None:
        self.pool.take_hold(hold.request_id)
        self.log.log("DEBUG", "get_finished", vl.MSG_GET_FINISHED, 0, 1, 0, 0)
        self.log.log("DEBUG", "finished_sending", vl.MSG_FINISHED_SENDING, hold.request_id)
        self._released(hold, reason)

    # --- events ----------------------------------------------------------------------------------
    def report(self, state: RequestState) -> PrefillReport:
        """P's per-request report (the ``kvdiag`` key of its kv_transfer_params)."""
        r = state.read
        params = state.params or {}
        remote_engine = params.get("remote_engine_id") if isinstance(params.get("remote_engine_id"), str) else None
        remote_req = params.get("remote_request_id") if isinstance(params.get("remote_request_id"), str) else None
        view = PrefillView(
            engine_request_id=state.internal_id, prompt_tokens=len(state.prompt),
            block_size=self.config.block_size, has_handle=has_handle(params) and r.invalid is None,
            engine_id=self.engine_id, remote_engine_id=remote_engine[:256] if remote_engine else None,
            remote_request_id=remote_req[:512] if remote_req else None,
            remote_offered_tokens=r.remote_num_tokens, local_hit_tokens=state.hit_tokens,
            mismatch_block=r.mismatch_block, request_failed=state.status == "error",
            failed_reason=state.error, mismatch_tokens=r.mismatch_tokens, pull_limit_tokens=r.pull_limit_tokens)
        if r.started:
            view.read_started(r.read_tokens or r.affected_tokens)
            if r.failure_type is not None:
                view.read_failed(r.failure_type)
            elif r.read_tokens:
                view.read_done(r.transfer_bytes, r.transfer_ms)
        report = view.report(bidirectional=self.faults.bidirectional_kv_xfer,
                             threshold=self.faults.kv_recompute_threshold)
        report = replace(report, wrong_kv_tokens=state.wrong_kv_tokens)
        notes = [n for n in (r.invalid, r.reason if r.failed else None, r.digest_error and
                             f"kvdiag_digest not used: {r.digest_error}") if n]
        if r.stale and report.outcome == Verdict.REMOTE_HIT.value:
            # Only the sim can know this; the real connector would see a successful (stale) read.
            report = replace(report, outcome=Verdict.EXPIRED_REMOTE_READ.value)
            notes.append("D no longer held the blocks (released before the read): stale KV was read")
        if r.notification_failed:
            notes.append("notification to D failed: D keeps the blocks until its TTL")
        if notes:
            report = replace(report, reason="; ".join([*([report.reason] if report.reason else []), *notes]))
        if r.notification_failed and report.failure_type is None:
            report = replace(report, failure_type="notification_failed")
        return report

    def emit_request(self, state: RequestState) -> None:
        """The per-request event: prefill_request on a prefill engine, decode_request on a decode engine."""
        if self.sink is None or state.emitted:
            return
        state.emitted = True
        fields: dict[str, Any] = {
            "request_id": state.request_id, "engine_request_id": state.internal_id,
            "prompt_tokens": len(state.prompt), "completion_tokens": len(state.output),
            "local_hit_tokens": state.hit_tokens, "computed_tokens": max(0, state.computed_tokens),
            "remote_read_tokens": state.read.read_tokens, "prefill_ms": round(state.prefill_ms, 3),
            "duration_ms": round((time.perf_counter() - state.t_arrival) * 1000.0, 3),
            "status": state.status, "attrs": {"role": state.role, "finish_reason": state.finish_reason}}
        if state.t_first_token is not None:
            fields["ttft_ms"] = round((state.t_first_token - state.t_arrival) * 1000.0, 3)
        if state.read.transfer_bytes:
            fields.update(transfer_bytes=state.read.transfer_bytes, transfer_ms=round(state.read.transfer_ms, 3))
        fields["wrong_kv_tokens"] = state.wrong_kv_tokens
        if state.role == "P":
            rep = self.report(state)
            fields.update(outcome=rep.outcome, reason=rep.reason, failure_type=rep.failure_type,
                          remote_offered_tokens=rep.remote_offered_tokens, remote_engine_id=rep.remote_engine_id,
                          remote_request_id=rep.remote_request_id, mismatch_tokens=rep.mismatch_tokens)
            series = self.metrics.connector("kvdiag_connector_requests", role="prefill", outcome=rep.outcome)
            if series is not None:
                series.inc()
        elif state.error:
            fields["reason"] = state.error
        self.emit("prefill_request" if self.config.role == "prefill" else "decode_request", **fields)

    def emit(self, event: str, **fields: Any) -> None:
        """Write one TurnEvent (instrumented mode only); never raises."""
        if self.sink is None:
            return
        try:
            self.sink.emit(TurnEvent(ts=now_ts(), source=self.config.role, event=event, engine_id=self.engine_id,
                                     model=self.config.model, **fields))
        except (TypeError, ValueError):
            _logger.warning("could not build %s event", event, exc_info=True)
            self._count_emit_error()
