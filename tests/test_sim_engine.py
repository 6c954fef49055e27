"""The emulated engines over real sockets: kv_transfer_params fields and semantics, events, metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvdiag.schema.events import PrefillReport, TurnEvent, read_events
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.pd_driver import TurnResult, run_turn
from kvdiag.sim.server import EngineHandle, start_engine
from kvdiag.sim.tokenizer import generate_text

Factory = Callable[..., Awaitable[EngineHandle]]

D_PARAM_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
                "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                "remote_blocks_expiry_time", "remote_registration_generation", "transfer_mode"}
P_PARAM_KEYS = D_PARAM_KEYS | {"remote_prefill_cached_tokens"}


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[Factory]:
    started: list[EngineHandle] = []

    async def make(role: str, **kw: Any) -> EngineHandle:
        kw.setdefault("time_scale", 0.0)
        kw.setdefault("log_file", str(tmp_path / f"{role}.log"))
        kw.setdefault("log_level", "DEBUG")
        kw.setdefault("mode", "instrumented")
        kw.setdefault("events_file", str(tmp_path / f"{role}-events.jsonl"))
        handle = await start_engine(EngineConfig(role=role, **kw))
        started.append(handle)
        return handle

    yield make
    for handle in started:
        await handle.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


def _log(tmp_path: Path, role: str) -> str:
    return (tmp_path / f"{role}.log").read_text()


def _events(handle: EngineHandle) -> list[TurnEvent]:
    sink = handle.engine.sink
    assert sink is not None and sink.flush()
    return list(read_events(sink.path))


def _msgs(n_words: int = 120, seed: int = 7) -> list[dict[str, Any]]:
    return [{"role": "user", "content": generate_text(seed, n_words)}]


def _next(messages: list[dict[str, Any]], turn: TurnResult, n_words: int = 80) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": turn.reply},
            {"role": "user", "content": generate_text(len(messages), n_words)}]


async def _two_turns(session: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle, reply: int = 64,
                     gap_s: float = 0.0) -> tuple[TurnResult, TurnResult]:
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "conv1-t1", max_tokens=reply)
    assert t1.d_params is not None
    if gap_s:
        await asyncio.sleep(gap_s)
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "conv1-t2", max_tokens=reply)
    return t1, t2


async def test_two_turns_read_back_from_d(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    t1, t2 = await _two_turns(session, p, d)
    d1 = t1.d_params
    assert d1 is not None and set(d1) == D_PARAM_KEYS | {"kvdiag_digest"}  # instrumented D: the connector's digest
    assert d1["do_remote_decode"] is True and d1["do_remote_prefill"] is False
    assert re.fullmatch(r"chatcmpl-conv1-t1-[0-9a-f]{8}", d1["remote_request_id"])
    assert d1["remote_engine_id"] == d.engine_id and d1["remote_port"] == d.side_channel_port
    assert d1["transfer_mode"] == "pull" and d1["tp_size"] == 1
    prompt1 = t1.p_body["usage"]["prompt_tokens"]
    assert d1["remote_num_tokens"] == prompt1 + 64 - 1
    assert len(d1["remote_block_ids"][0]) == -(-d1["remote_num_tokens"] // 16)
    # D's deadline lives in D's perf_counter domain (same process here), TTL 480 s from now.
    assert abs(d1["remote_blocks_expiry_time"] - (time.perf_counter() + 480.0)) < 5.0
    p2 = t2.p_params
    assert p2 is not None and set(p2) == P_PARAM_KEYS | {"kvdiag"}
    assert p2["remote_blocks_expiry_time"] is None and p2["do_remote_prefill"] is True
    report = PrefillReport.from_dict(p2["kvdiag"])
    assert report.outcome == "remote_hit" and report.local_hit_tokens == 0
    assert report.remote_read_tokens == d1["remote_num_tokens"]
    assert report.remote_request_id == d1["remote_request_id"]
    assert report.transfer_bytes == report.remote_read_tokens * 262_144
    assert t2.p_body["usage"]["prompt_tokens_details"]["cached_tokens"] == d1["remote_num_tokens"]
    assert p2["remote_prefill_cached_tokens"] == d1["remote_num_tokens"]
    d_log = _log(tmp_path, "decode")
    assert f"Finished sending KV transfer for request {d1['remote_request_id']}" in d_log
    released = [e for e in _events(d) if e.event == "kv_released"]
    assert [(e.engine_request_id, e.request_id, e.release_reason) for e in released] == [
        (d1["remote_request_id"], "conv1-t1", "read")]
    prefill_events = [e for e in _events(p) if e.event == "prefill_request"]
    assert [e.outcome for e in prefill_events] == ["unknown", "remote_hit"]
    assert prefill_events[1].request_id == "conv1-t2" and prefill_events[1].transfer_bytes == report.transfer_bytes


async def test_single_read_second_use_reads_released_blocks(engines: Factory, session: aiohttp.ClientSession,
                                                           tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    t1, t2 = await _two_turns(session, p, d)
    assert t2.report is not None and t2.report["outcome"] == "remote_hit"
    # Replaying the same handle: D freed the blocks at the first read; the read finds nothing held.
    again = await run_turn(session, p.url, d.url, _next(_msgs(), t1), t1.d_params, "conv1-t2b")
    assert again.report is not None and again.report["outcome"] == "expired_remote_read"
    assert t1.d_params is not None
    assert (f"Potentially invalid KV blocks for unrecognized request {t1.d_params['remote_request_id']} were "
            "retrieved by a decode worker. They may have expired.") in _log(tmp_path, "decode")


async def test_threshold_skip_notifies_d(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill")  # prefix caching on: only the short reply is left to pull
    d = await engines("decode")
    t1, t2 = await _two_turns(session, p, d, reply=40)
    assert t2.report is not None and t2.report["outcome"] == "below_threshold"
    assert t2.report["remote_read_tokens"] == 0
    r = min(t2.report["remote_offered_tokens"], t2.report["prompt_tokens"]) - t2.report["local_hit_tokens"]
    assert 16 <= r < 64
    assert t1.d_params is not None
    p_log = _log(tmp_path, "prefill")
    internal = t2.report["engine_request_id"]
    assert f"Skipping remote pull for {internal}: {r} remote tokens < threshold 64" in p_log
    released = [e for e in _events(d) if e.event == "kv_released"]
    assert released[0].release_reason == "notify_only"


async def test_local_hit_when_less_than_a_block_remains(engines: Factory, session: aiohttp.ClientSession) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "c-t1", max_tokens=3)
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "c-t2")
    assert t2.report is not None and t2.report["outcome"] == "local_hit"


async def test_high_threshold_skips_on_prefix_cache_off(engines: Factory, session: aiohttp.ClientSession) -> None:
    p = await engines("prefill", prefix_caching=False, kv_recompute_threshold=100_000)
    d = await engines("decode")
    _, t2 = await _two_turns(session, p, d)
    assert t2.report is not None and t2.report["outcome"] == "below_threshold"


async def test_ttl_expiry_releases_and_p_declines(engines: Factory, session: aiohttp.ClientSession,
                                                 tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False, expiry_safety_margin_s=0.1)
    d = await engines("decode", decoder_kv_blocks_ttl=0.3)
    t1, t2 = await _two_turns(session, p, d, gap_s=0.5)
    assert t1.d_params is not None
    d_log = _log(tmp_path, "decode")
    assert (f"Releasing expired KV blocks for request {t1.d_params['remote_request_id']} which were retrieved by 0 "
            "remote worker(s) before lease expired.") in d_log
    # vLLM 0.33's API server: a request finished with finish_reason error is an HTTP 500 error object
    assert t2.p_status == 500 and t2.p_body["error"]["type"] == "InternalServerError"
    report = t2.report  # instrumented: in the error object
    assert "kv_transfer_params" not in t2.p_body
    assert report is not None and report["outcome"] == "expired_remote_read"
    p_log = _log(tmp_path, "prefill")
    internal = report["engine_request_id"]
    assert f"Declining expired remote read for {internal} from engine {d.engine_id}." in p_log
    assert f"Skipping KV post-processing for failed request {internal}" in p_log
    assert re.search(r"ERROR .* Failing 1 request\(s\) due to KV load failure \(failure_policy=fail, \d+ tokens "
                     rf"affected\)\. Request IDs: \{{'{internal}'\}}", p_log)
    released = [e for e in _events(d) if e.event == "kv_released"]
    assert released[0].release_reason == "expired"


async def test_decline_near_expiry_in_stock_mode(engines: Factory, session: aiohttp.ClientSession,
                                                 tmp_path: Path) -> None:
    # A TTL within vLLM's 5 s safety margin is declined at once, although D still holds the blocks.
    p = await engines("prefill", prefix_caching=False, mode="stock", events_file=None)
    d = await engines("decode", decoder_kv_blocks_ttl=4.0, mode="stock", events_file=None)
    t1, t2 = await _two_turns(session, p, d)
    assert t2.p_status == 500  # stock vLLM 0.33: no params, the API server's error object
    assert t2.p_body == {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                                   "code": 500}}
    assert "Declining expired remote read for chatcmpl-conv1-t2-" in _log(tmp_path, "prefill")
    assert t1.d_params is not None and t1.d_params["remote_request_id"] in d.engine.pool.holds


async def test_policy_recompute_recovers(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False, kv_load_failure_policy="recompute")
    d = await engines("decode", decoder_kv_blocks_ttl=4.0)
    _, t2 = await _two_turns(session, p, d)
    assert t2.d_status == 200 and t2.p_body["choices"][0]["finish_reason"] == "length"
    assert t2.report is not None and t2.report["outcome"] == "expired_remote_read"
    assert t2.report["remote_read_tokens"] == 0 and t2.report["computed_tokens"] == t2.report["prompt_tokens"]
    assert re.search(r"WARNING .* Recovered from KV load failure: 1 request\(s\) rescheduled \(\d+ tokens "
                     r"affected\)\.", _log(tmp_path, "prefill"))


async def test_hang_on_recompute_reproduces_waiting_for_remote_kvs(engines: Factory, session: aiohttp.ClientSession,
                                                                   tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False, kv_load_failure_policy="recompute", hang_on_recompute=True)
    d = await engines("decode", decoder_kv_blocks_ttl=4.0)
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "h-t1")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "h-t2"), 0.8)
    p_log = _log(tmp_path, "prefill")
    assert re.search(r"chatcmpl-h-t2-[0-9a-f]{8} is still in WAITING_FOR_REMOTE_KVS state\.", p_log)
    assert "Recovered from KV load failure" not in p_log
    hung = [e for e in _events(p) if e.status == "hung"]
    assert len(hung) == 1 and hung[0].outcome == "expired_remote_read"
    for _ in range(40):  # the client gave up: the hung request goes away with its connection
        if p.engine.waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert p.engine.waiting == 0


async def test_bidirectional_off_on_p_ignores_handle(engines: Factory, session: aiohttp.ClientSession,
                                                     tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False, bidirectional_kv_xfer=False)
    d = await engines("decode")
    _, t2 = await _two_turns(session, p, d)
    assert t2.report is not None and t2.report["outcome"] == "feature_disabled_on_prefill"
    assert t2.report["remote_read_tokens"] == 0
    # vLLM's only trace of the switch: P lacks the startup line that D (on) writes.
    assert "Bidirectional KV transfer is enabled" not in _log(tmp_path, "prefill")
    assert "Bidirectional KV transfer is enabled" in _log(tmp_path, "decode")
    assert "Declining expired remote read" not in _log(tmp_path, "prefill")


async def test_bidirectional_off_on_d_returns_no_params(engines: Factory, session: aiohttp.ClientSession,
                                                        tmp_path: Path) -> None:
    p = await engines("prefill")
    d = await engines("decode", bidirectional_kv_xfer=False)
    t1 = await run_turn(session, p.url, d.url, _msgs(), None, "off-t1")
    assert t1.d_status == 200 and t1.reply
    assert t1.d_chunks[-1]["kv_transfer_params"] is None
    assert not d.engine.pool.holds
    assert "Bidirectional KV transfer is enabled" not in _log(tmp_path, "decode")


async def test_streaming_with_and_without_params(engines: Factory, session: aiohttp.ClientSession) -> None:
    p = await engines("prefill")
    d = await engines("decode", stream_kv_params=False)
    streamed = await run_turn(session, p.url, d.url, _msgs(), None, "s-t1", stream=True)
    assert streamed.d_params is None and streamed.reply
    assert all("kv_transfer_params" not in c for c in streamed.d_chunks)
    plain = await run_turn(session, p.url, d.url, _msgs(), None, "s-t2", stream=False)
    assert plain.d_params is not None and plain.d_params["do_remote_decode"] is True
    assert plain.reply == streamed.reply  # deterministic generation for the same prompt
    # runtime switch: PR #40186 behaviour back on
    async with session.post(f"{d.url}/kvdiag/admin/faults", json={"stream_kv_params": True}) as resp:
        assert resp.status == 200
    again = await run_turn(session, p.url, d.url, _msgs(), None, "s-t3", stream=True)
    assert again.d_params is not None and again.d_chunks[-1]["choices"][0]["finish_reason"] == "length"


FAILURE_LINES = {
    "handshake_failed": "NIXL transfer failure: handshake_failed | Context: {'failure_type': 'handshake_failed', "
                        "'request_id': 'chatcmpl-f-t2-",
    "handshake_setup_failed": "NIXL transfer failure: handshake_setup_failed | Context: {'failure_type': "
                              "'handshake_setup_failed', 'request_id': None,",
    "transfer_failed": "NIXL transfer failure: transfer_failed. Marking blocks as invalid | Context: "
                       "{'failure_type': 'transfer_failed', 'request_id': 'chatcmpl-f-t2-",
    "transfer_setup_failed": "NIXL transfer failure: transfer_setup_failed. Marking blocks as invalid | Context: "
                             "{'failure_type': 'transfer_setup_failed', 'request_id': 'chatcmpl-f-t2-",
    "notification_failed": "NIXL transfer failure: notification_failed. P worker blocks will be freed after "
                           "timeout. This may indicate network issues. | Context: {'failure_type': "
                           "'notification_failed', 'request_id': 'chatcmpl-f-t2-",
}


@pytest.mark.parametrize("failure_type", sorted(FAILURE_LINES))
async def test_fail_transfers_writes_vllm_lines(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path,
                                                failure_type: str) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "f-t1")
    async with session.post(f"{p.url}/kvdiag/admin/faults", json={"fail_transfers": {failure_type: 1.0}}) as resp:
        assert resp.status == 200
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "f-t2")
    p_log = _log(tmp_path, "prefill")
    assert FAILURE_LINES[failure_type] in p_log
    assert t2.report is not None
    if failure_type == "notification_failed":
        # The read itself worked; D was not told, so it keeps the blocks until the TTL.
        assert t2.report["outcome"] == "remote_hit" and t2.report["failure_type"] == failure_type
        assert t1.d_params is not None and t1.d_params["remote_request_id"] in d.engine.pool.holds
    else:
        assert t2.report["outcome"] == "transfer_failed" and t2.report["failure_type"] == failure_type
        assert "Failing 1 request(s) due to KV load failure (failure_policy=fail" in p_log


async def test_d_restart_fails_the_read(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "r-t1")
    old_id = d.engine_id
    async with session.post(f"{d.url}/kvdiag/admin/restart") as resp:
        new_id = (await resp.json())["engine_id"]
    assert new_id != old_id and not d.engine.pool.holds
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "r-t2")
    assert t2.report is not None and t2.report["outcome"] == "transfer_failed"
    p_log = _log(tmp_path, "prefill")
    assert f"RuntimeError: Remote NIXL agent engine ID mismatch. Expected {old_id},received {new_id}." in p_log
    assert "NIXL transfer failure: handshake_failed | Context:" in p_log
    reasons = [e.release_reason for e in _events(d) if e.event == "kv_released"]
    assert reasons == ["restart"]


async def test_memory_pressure_eviction_before_read(engines: Factory, session: aiohttp.ClientSession,
                                                    tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "e-t1")
    async with session.post(f"{d.url}/kvdiag/admin/evict") as resp:
        assert (await resp.json()) == {"evicted": 1}
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "e-t2")
    assert t2.report is not None and t2.report["outcome"] == "expired_remote_read"
    assert t1.d_params is not None
    assert (f"ERROR {time.strftime('%m-%d')}" in _log(tmp_path, "decode")
            and f"Potentially invalid KV blocks for unrecognized request {t1.d_params['remote_request_id']}"
            in _log(tmp_path, "decode"))


async def test_capacity_pressure_evicts_oldest_retained(engines: Factory, session: aiohttp.ClientSession,
                                                        tmp_path: Path) -> None:
    p = await engines("prefill")
    d = await engines("decode", num_blocks=40)
    first = await run_turn(session, p.url, d.url, _msgs(400, seed=1), None, "cap-1")
    assert first.d_params is not None
    second = await run_turn(session, p.url, d.url, _msgs(400, seed=2), None, "cap-2")
    assert second.d_params is not None and list(d.engine.pool.holds) == [second.d_params["remote_request_id"]]
    reasons = [e.release_reason for e in _events(d) if e.event == "kv_released"]
    assert reasons == ["evicted"]


async def test_fail_requests_returns_500(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", fail_requests=1.0)
    async with session.post(f"{p.url}/v1/chat/completions", json={
            "messages": _msgs(), "kv_transfer_params": {"do_remote_decode": True}}) as resp:
        assert resp.status == 500
    events = [e for e in _events(p) if e.event == "prefill_request"]
    assert events[0].outcome == "request_failed" and events[0].status == "error"


async def test_startup_line_and_request_logging(engines: Factory, session: aiohttp.ClientSession,
                                                tmp_path: Path) -> None:
    d = await engines("decode", log_level="INFO", enable_log_requests=True)
    async with session.post(f"{d.url}/v1/completions", headers={"X-Request-Id": "abc"},
                            json={"prompt": "hello world", "max_tokens": 4}) as resp:
        body = await resp.json()
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 4 and body["kv_transfer_params"] is None
    log = _log(tmp_path, "decode")
    pid = d.engine.pid
    assert re.search(rf"^\(EngineCore_DP0 pid={pid}\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[base_scheduler\.py:188\] "
                     r"Bidirectional KV transfer is enabled and the kv recompute threshold is set to 64 tokens\.KV "
                     r"blocks on D are released after a TTL of 480 seconds\.$", log, re.M)
    assert re.search(rf"^\(APIServer pid={pid}\) INFO .* \[logger\.py:\d+\] Received request cmpl-abc: params: "
                     r"SamplingParams\(.*\), lora_request: None\.$", log, re.M)
    assert f"(APIServer pid={pid}) INFO" in log and "Added request cmpl-abc." in log
    assert re.search(r"Generated response cmpl-abc: output: '.+', output_token_ids: \[.*\], finish_reason: length",
                     log)


async def test_metrics_expose_vllm_names(engines: Factory, session: aiohttp.ClientSession) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    await _two_turns(session, p, d)
    async with session.get(f"{p.url}/metrics") as resp:
        text = await resp.text()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_by_source_total",
                 "vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_sum",
                 "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc",
                 "vllm:num_requests_running", "kvdiag_connector_requests_total"):
        assert name in text, name
    assert 'vllm:nixl_bytes_transferred_count{engine="0",model_name="Qwen/Qwen3-32B"} 1.0' in text
    assert re.search(r'kvdiag_connector_requests_total\{.*outcome="remote_hit".*\} 1\.0', text)


async def test_admin_rejects_unknown_switch(engines: Factory, session: aiohttp.ClientSession) -> None:
    p = await engines("prefill")
    async with session.post(f"{p.url}/kvdiag/admin/faults", json={"no_such_switch": 1}) as resp:
        assert resp.status == 400
        assert "no_such_switch" in (await resp.json())["error"]["message"]
    async with session.post(f"{p.url}/kvdiag/admin/faults", json={"fail_transfers": "bogus"}) as resp:
        assert resp.status == 400


async def test_untrusted_handle_host_is_refused(engines: Factory, session: aiohttp.ClientSession,
                                                tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    handle = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "x",
              "remote_request_id": "y", "remote_host": "203.0.113.9", "remote_port": 5600, "remote_num_tokens": 32}
    async with session.post(f"{p.url}/v1/chat/completions", json={"messages": _msgs(),
                                                                   "kv_transfer_params": handle}) as resp:
        body = await resp.json()
    assert resp.status == 200
    assert body["kv_transfer_params"]["kvdiag"]["outcome"] == "unknown"
    assert "Got invalid KVTransferParams:" in _log(tmp_path, "prefill")


async def test_periodic_stat_lines(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False, log_level="INFO", log_stats_interval_s=0.05)
    d = await engines("decode", log_level="INFO", log_stats_interval_s=0.05)
    await _two_turns(session, p, d)
    await asyncio.sleep(0.2)
    p_log = _log(tmp_path, "prefill")
    pid = p.engine.pid
    assert re.search(rf"^\(APIServer pid={pid}\) INFO .* \[metrics\.py:108\] KV Transfer metrics: Num successful "
                     r"transfers=1, Avg xfer time \(ms\)=[\d.]+, P90 xfer time \(ms\)=[\d.]+, .*Avg MB per "
                     r"transfer=[\d.]+, Throughput \(MB/s\)=[\d.]+, Avg number of descriptors=[\d.]+, Num failed "
                     r"transfers=0, Num KV expired reqs=0, Num notifs after expiry=0$", p_log, re.M)
    assert re.search(rf"^\(APIServer pid={pid}\) INFO .* \[loggers\.py:335\] Engine 000: Avg prompt throughput: "
                     r"[\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, Running: \d+ reqs, "
                     r"Waiting: \d+ reqs, "
                     r"GPU KV cache usage: [\d.]+%, External prefix cache hit rate: [\d.]+%$", p_log, re.M)
    assert "Prefix cache hit rate" in _log(tmp_path, "decode")  # D has prefix caching on


async def test_client_disconnect_mid_stream_aborts(engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines("decode", time_scale=0.1)  # 2 ms per decode step
    body = {"messages": _msgs(), "max_tokens": 400, "stream": True,
            "kv_transfer_params": {"do_remote_prefill": True}}
    async with session.post(f"{d.url}/v1/chat/completions", json=body) as resp:
        await resp.content.readline()
        resp.close()
    for _ in range(100):
        if d.engine.running == 0:
            break
        await asyncio.sleep(0.02)
    events = [e for e in _events(d) if e.event == "decode_request"]
    assert [(e.status, e.attrs["finish_reason"]) for e in events] == [("aborted", "abort")]
    assert not d.engine.pool.holds  # vLLM returns no params and holds nothing for an aborted request


async def test_p_lease_expires_when_d_never_reads(engines: Factory, session: aiohttp.ClientSession,
                                                  tmp_path: Path) -> None:
    p = await engines("prefill", kv_lease_duration=0.1)
    async with session.post(f"{p.url}/v1/chat/completions", headers={"X-Request-Id": "lease"},
                            json={"messages": _msgs(), "kv_transfer_params": {"do_remote_decode": True}}) as resp:
        params = (await resp.json())["kv_transfer_params"]
    await asyncio.sleep(0.3)
    assert (f"Releasing expired KV blocks for request {params['remote_request_id']} which were retrieved by 0 "
            "remote worker(s) before lease expired.") in _log(tmp_path, "prefill")
    assert not p.engine.pool.holds


@pytest.mark.parametrize(("body", "status", "text"), [
    ({"messages": "hi"}, 400, "'messages' must be a list"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "The model `other` does not exist."),
])
async def test_bad_requests_get_openai_errors(engines: Factory, session: aiohttp.ClientSession,
                                              body: dict[str, Any], status: int, text: str) -> None:
    d = await engines("decode")
    async with session.post(f"{d.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == status
        assert text in (await resp.json())["error"]["message"]
