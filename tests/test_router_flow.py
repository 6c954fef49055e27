"""The router's per-turn flow over real sockets, against a scriptable P/D (router_support.FakeBackend)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from router_support import FakeBackend, d_params, fake_backends, free_port, read_jsonl, wait_for

from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.router.security import hash_conversation_id, loggable_as_is
from kvdiag.router.store import MemoryStore, Store
from kvdiag.schema.events import read_events

CHAT = "/v1/chat/completions"
REPLY = "tok1 tok2 "  # what FakeBackend's D streams: sent back verbatim, the full handle is reused


@contextlib.asynccontextmanager
async def router_for(ps: list[FakeBackend], ds: list[FakeBackend], tmp: Path, *, store: Store | None = None,
                     registry: CollectorRegistry | None = None, prefill_ports: list[int] | None = None,
                     span_exporter: Any = None, **kw: Any) -> AsyncIterator[RouterHandle]:
    config = RouterConfig(
        prefill=tuple(Upstream("127.0.0.1", p) for p in (prefill_ports or [b.port for b in ps])),
        decode=tuple(Upstream("127.0.0.1", d.port) for d in ds), host="127.0.0.1", port=0,
        events_file=tmp / "router-events.jsonl", **kw)
    handle = await start_router(config, store=store, registry=registry, span_exporter=span_exporter)
    try:
        yield handle
    finally:
        await handle.close()


def _chat(*contents: str, conv: str | None = "conv-1", stream: bool = True, **extra: Any) -> dict[str, Any]:
    roles = ["user", "assistant"]
    body: dict[str, Any] = {"model": "m", "messages": [{"role": roles[i % 2], "content": c}
                                                       for i, c in enumerate(contents)],
                            "max_tokens": 8, "min_tokens": 2, "stream": stream,
                            "stream_options": {"include_usage": False}}
    if conv is not None:
        body["conversation_id"] = conv
    body.update(extra)
    return body


async def _post(url: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, bytes, CIMultiDict[str]]:
    async with aiohttp.ClientSession() as s, s.post(url + CHAT, json=body, headers=headers or {}) as r:
        return r.status, await r.read(), CIMultiDict(r.headers)


def _events(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "router-events.jsonl"
    if path.exists():
        assert all(e.event == "router_turn" for e in read_events(path))  # schema-valid, or it raises
    return read_jsonl(path)


async def _events_n(tmp: Path, n: int) -> list[dict[str, Any]]:
    await wait_for(lambda: len(_events(tmp)) >= n)
    return _events(tmp)


async def test_two_turns_carry_d_params_to_p(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        status, raw1, headers = await _post(r.url, _chat("hi"))
        assert status == 200 and raw1.endswith(b"data: [DONE]\n\n"), (headers, raw1)
        rid1 = headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid1)
        # Same X-Request-Id on both legs; conversation_id and the client's knobs handled as the example proxy.
        assert ps[0].headers[0]["X-Request-ID"] == ds[0].headers[0]["X-Request-ID"] == rid1
        p1, d1 = ps[0].requests[0], ds[0].requests[0]
        assert "conversation_id" not in p1 and "conversation_id" not in d1
        assert p1["stream"] is False and p1["max_tokens"] == 1
        assert "min_tokens" not in p1 and "stream_options" not in p1
        assert p1["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_engine_id": None, "remote_block_ids": None,
                                            "remote_host": None, "remote_port": None}
        assert d1["stream"] is True and d1["min_tokens"] == 2 and d1["stream_options"] == {"include_usage": False}
        assert d1["kv_transfer_params"]["remote_engine_id"] == "p-engine-1"
        assert d1["kv_transfer_params"]["remote_host"] == "127.0.0.1"  # P's host, as the example proxy
        # Bytes reach the client unchanged (including D's final chunk).
        assert b'"remote_request_id": "chatcmpl-' + rid1.encode() in raw1

        status, _, headers2 = await _post(r.url, _chat("hi", REPLY, "more"))
        assert status == 200
        p2 = ps[0].requests[1]["kv_transfer_params"]
        expected = d_params(rid1)
        expected.update(do_remote_decode=True, do_remote_prefill=False, remote_host="127.0.0.1")
        assert p2 == expected  # ints stay ints, remote_blocks_expiry_time untouched
        assert isinstance(p2["remote_port"], int) and p2["remote_blocks_expiry_time"] == 123456.789

        ev1, ev2 = await _events_n(tmp_path, 2)
        assert ev1["outcome"] == "first_turn" and ev1["turn"] == 1 and ev1["lookup"] == "miss"
        assert ev1["attrs"]["stored"] is True and ev1["conversation_id"] == "conv-1"
        assert ev2["turn"] == 2 and ev2["lookup"] == "hit" and ev2["request_id"] == headers2["X-Request-Id"]
        assert ev2["outcome"] == "unknown"  # stock fake P reported 0 cached tokens
        assert ev2["remote_request_id"] == f"chatcmpl-{rid1}-abcd1234" and ev2["entry_age_s"] >= 0
        for ev in (ev1, ev2):
            assert ev["source"] == "router" and ev["event"] == "router_turn" and ev["status"] == "ok"
            assert ev["ttft_ms"] > 0 and ev["prefill_ms"] > 0 and ev["decode_ms"] > 0
            assert ev["duration_ms"] >= ev["prefill_ms"] + ev["decode_ms"] - 1


async def test_p_report_gives_the_verdict_and_is_not_sent_to_d(tmp_path: Path) -> None:
    report = {"v": 1, "engine_request_id": "chatcmpl-x-1", "prompt_tokens": 30, "local_hit_tokens": 0,
              "remote_offered_tokens": 28, "remote_read_tokens": 28, "computed_tokens": 2, "outcome": "remote_hit",
              "transfer_bytes": 98304, "transfer_ms": 4.5, "engine_id": "p-engine-1"}
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        await _post(r.url, _chat("hi"))
        ps[0].p_report = report
        await _post(r.url, _chat("hi", REPLY, "more"))
        assert "kvdiag" not in ds[0].requests[1]["kv_transfer_params"]
        ev = (await _events_n(tmp_path, 2))[1]
        assert ev["outcome"] == "remote_hit" and ev["transfer_bytes"] == 98304 and ev["remote_read_tokens"] == 28
        assert ev["engine_request_id"] == "chatcmpl-x-1"
        assert registry.get_sample_value("kvdiag_transfer_bytes_count", {"model": "m"}) == 1
        assert registry.get_sample_value("kvdiag_turns_total", {"model": "m", "outcome": "remote_hit",
                                                                "turn_bucket": "2", "prompt_bucket": "<2k"}) == 1
        assert registry.get_sample_value("kvdiag_prompt_tokens_total", {"model": "m", "source": "remote_read"}) \
            == 28


async def test_conversation_id_header_and_non_streaming(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        status, raw, _ = await _post(r.url, _chat("hi", conv=None, stream=False),
                                     headers={"X-Conversation-Id": "hdr-1"})
        body = json.loads(raw)
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello world"
        assert "kv_transfer_params" not in body  # D's handle stays with the router
        assert ds[0].requests[0]["stream"] is False
        await _post(r.url, _chat("hi", "hello world", "more", conv=None, stream=False),
                    headers={"X-Conversation-Id": "hdr-1"})
        assert ps[0].requests[1]["kv_transfer_params"]["remote_engine_id"] == "d-engine-1"


async def test_client_params_are_dropped(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    evil = {"do_remote_decode": True, "remote_engine_id": "victim", "remote_block_ids": [[1]]}
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        await _post(r.url, _chat("hi", kv_transfer_params=evil))
        assert ps[0].requests[0]["kv_transfer_params"]["remote_engine_id"] is None
        assert ds[0].requests[0]["kv_transfer_params"]["remote_engine_id"] == "p-engine-1"
        assert registry.get_sample_value("kvdiag_client_params_dropped_total") == 1
        ev = (await _events_n(tmp_path, 1))[0]
        assert ev["attrs"]["client_kv_transfer_params_dropped"] is True


async def test_model_list_carries_the_key_and_the_engine_answer(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r, aiohttp.ClientSession() as s:
        async with s.get(r.url + "/v1/models", headers={"Authorization": "Bearer tenant-a"}) as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "decode-model"
        assert ds[0].headers[-1]["Authorization"] == "Bearer tenant-a" and not ps[0].headers
        # a client error is the engine's answer to give (a wrong key), not a failure to try P for
        ds[0].models_status = 401
        async with s.get(r.url + "/v1/models") as resp:
            assert resp.status == 401 and not ps[0].headers
        ds[0].models_status = 503
        async with s.get(r.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "prefill-model"


async def test_tenants_never_share_handles(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        await _post(r.url, _chat("hi"), headers={"Authorization": "Bearer tenant-a"})
        await _post(r.url, _chat("hi", REPLY, "y"), headers={"Authorization": "Bearer tenant-b"})
        assert ps[0].requests[1]["kv_transfer_params"]["remote_engine_id"] is None
        await _post(r.url, _chat("hi", REPLY, "y"), headers={"Authorization": "Bearer tenant-a"})
        assert ps[0].requests[2]["kv_transfer_params"]["remote_engine_id"] == "d-engine-1"
        assert ds[0].headers[0]["Authorization"] == "Bearer tenant-a"  # forwarded to the engines
        evs = await _events_n(tmp_path, 3)
        assert evs[1]["outcome"] == "router_state_lost" and evs[0]["tenant"] != evs[1]["tenant"]


async def test_prefix_mismatch_is_not_injected(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        await _post(r.url, _chat("hi there"))
        await _post(r.url, _chat("hi (edited)", "x", "more"))
        assert ps[0].requests[1]["kv_transfer_params"]["remote_engine_id"] is None
        ev = (await _events_n(tmp_path, 2))[1]
        assert ev["outcome"] == "prefix_mismatch" and ev["lookup"] == "prefix_mismatch"


async def test_frames_split_across_reads_are_captured(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        ds[0].d_mode = "split"
        await _post(r.url, _chat("hi"))
        await _post(r.url, _chat("hi", REPLY, "y"))
        assert ps[0].requests[1]["kv_transfer_params"]["remote_engine_id"] == "d-engine-1"


async def test_missing_metadata_reasons_reach_the_next_turn(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        for i, (mode, reason) in enumerate([("no_key", "not_streamed"), ("null_params", "bidirectional_off_on_decode"),
                                            ("error_event", "decode_failed")]):
            ds[0].d_mode = mode
            await _post(r.url, _chat("hi", conv=f"c{i}"))
            ds[0].d_mode = "ok"
            await _post(r.url, _chat("hi", REPLY, "y", conv=f"c{i}"))
            ev = (await _events_n(tmp_path, 2 * i + 2))[-1]
            assert ev["outcome"] == "metadata_not_returned" and reason in ev["reason"], ev
            assert registry.get_sample_value("kvdiag_missing_metadata_total", {"model": "m", "reason": reason}) == 1


async def test_decode_failures_send_an_sse_error_and_store_nothing(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry,
                                                       decode_timeout=0.5) as r:
        for i, (mode, kind) in enumerate([("break", "stream_broken"), ("malformed", "malformed"),
                                          ("hang", "timeout"), ("no_done", "stream_broken")]):
            ds[0].d_mode = mode
            status, raw, _ = await _post(r.url, _chat("hi", conv=f"c{i}"))
            assert status == 200
            assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n"), (mode, raw[-300:])
            assert registry.get_sample_value("kvdiag_upstream_errors_total", {"leg": "decode", "kind": kind}) >= 1
            ds[0].d_mode = "ok"
            await _post(r.url, _chat("hi", REPLY, "y", conv=f"c{i}"))
            assert ps[0].requests[-1]["kv_transfer_params"]["remote_engine_id"] is None
            failed, following = (await _events_n(tmp_path, 2 * i + 2))[-2:]
            assert failed["status"] == "error" and failed["outcome"] == "request_failed"
            assert failed["attrs"]["stored"] is False and failed["attrs"]["missing_metadata_reason"] == "decode_failed"
            # The next turn knows why it has no handle.
            assert following["outcome"] == "metadata_not_returned" and "decode_failed" in following["reason"]


async def test_decode_http_error_is_a_502(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        ds[0].d_mode, ds[0].d_status = "status", 503
        status, raw, _ = await _post(r.url, _chat("hi"))
        assert status == 502 and json.loads(raw)["error"]["code"] == 502
        ds[0].d_status = 400
        status, raw, _ = await _post(r.url, _chat("hi"))
        assert status == 400 and json.loads(raw)["error"]["message"] == "decode boom"  # client errors pass through


async def test_malformed_upstream_json_is_a_clean_502_and_nothing_stored(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        ps[0].p_malformed = True  # P answers 200 with a truncated JSON body
        status, raw, _ = await _post(r.url, _chat("hi", conv="p-bad"))
        err = json.loads(raw)["error"]
        assert status == 502 and err["code"] == 502 and "not JSON" in err["message"], raw
        assert registry.get_sample_value("kvdiag_upstream_errors_total", {"leg": "prefill", "kind": "malformed"}) == 1
        assert not ds[0].requests  # D is never asked after a failed prefill
        ps[0].p_malformed = False
        ds[0].d_mode = "malformed"  # a non-streaming D answers 200 with a body that is not JSON
        status, raw, _ = await _post(r.url, _chat("hi", conv="d-bad", stream=False))
        err = json.loads(raw)["error"]
        assert status == 502 and err["code"] == 502 and "not JSON" in err["message"], raw
        assert registry.get_sample_value("kvdiag_upstream_errors_total", {"leg": "decode", "kind": "malformed"}) == 1
        ds[0].d_mode = "ok"
        await _post(r.url, _chat("hi", "hello world", "more", conv="d-bad", stream=False))
        assert ps[0].requests[-1]["kv_transfer_params"]["remote_engine_id"] is None  # nothing was stored
        p_bad, d_bad, following = await _events_n(tmp_path, 3)
        assert p_bad["outcome"] == "request_failed" and p_bad["status"] == "error"
        assert d_bad["outcome"] == "request_failed" and d_bad["attrs"]["stored"] is False
        assert following["outcome"] == "metadata_not_returned" and "decode_failed" in following["reason"]


async def test_prefill_5xx_retries_another_p_with_fresh_params(tmp_path: Path) -> None:
    async with fake_backends(n_prefill=2) as (ps, ds), router_for(ps, ds, tmp_path) as r:
        await _post(r.url, _chat("hi"))  # turn 1 on P0 (round robin), handle stored
        ps[1].p_status = 500
        status, _, _ = await _post(r.url, _chat("hi", REPLY, "y"))  # turn 2 starts on P1 with the handle
        assert status == 200
        assert ps[1].requests[0]["kv_transfer_params"]["remote_engine_id"] == "d-engine-1"
        # Retried with fresh params, never with the consumed handle.
        retried = [req["kv_transfer_params"] for req in ps[0].requests[1:]] + \
                  [req["kv_transfer_params"] for req in ps[1].requests[1:]]
        assert retried and all(p["remote_engine_id"] is None for p in retried)
        ev = (await _events_n(tmp_path, 2))[1]
        assert ev["outcome"] == "transfer_failed" and "retried without the handle" in ev["reason"]
        assert ev["attrs"]["prefill_attempts"] >= 2


async def test_prefill_failure_everywhere_is_a_502_and_the_unread_handle_is_given_back(tmp_path: Path) -> None:
    store = MemoryStore(capacity=100, entry_ttl=60, last_turn_ttl=600, lock_ttl=60)
    dead = free_port()
    async with fake_backends() as (ps, ds):
        async with router_for(ps, ds, tmp_path, store=store) as good:
            _, _, h1 = await _post(good.url, _chat("hi"))
        async with router_for(ps, ds, tmp_path / "dead", store=store, prefill_ports=[dead]) as bad:
            (tmp_path / "dead").mkdir(exist_ok=True)
            status, raw, _ = await _post(bad.url, _chat("hi", REPLY, "y"))
            assert status == 502
            err = json.loads(raw)["error"]
            assert err["code"] == 502 and "prefill failed" in err["message"]
        async with router_for(ps, ds, tmp_path / "again", store=store) as good2:
            await _post(good2.url, _chat("hi", REPLY, "y"))
        # P never read the handle, so turn 2's retry still gets turn 1's handle.
        assert ps[0].requests[-1]["kv_transfer_params"]["remote_request_id"] == \
            f"chatcmpl-{h1['X-Request-Id']}-abcd1234"


async def test_prefill_timeout_and_p_error_finish(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, prefill_timeout=0.3) as r:
        ps[0].p_delay = 1.0
        status, raw, _ = await _post(r.url, _chat("hi"))
        assert status == 502 and "longer than 0.3s" in json.loads(raw)["error"]["message"]
        ev = (await _events_n(tmp_path, 1))[0]
        assert ev["status"] == "timeout" and ev["outcome"] == "request_failed"
        ps[0].p_delay = 0
        ps[0].p_finish = "error"  # vLLM's KV load failure: HTTP 200, finish_reason error
        status, _, _ = await _post(r.url, _chat("hi", conv="c2"))
        assert status == 502


async def test_concurrent_turn_never_reads_the_handle_twice(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        await _post(r.url, _chat("hi"))
        ds[0].d_delay = 0.2
        await asyncio.gather(_post(r.url, _chat("hi", REPLY, "y")), _post(r.url, _chat("hi", REPLY, "y")))
        offered = [req["kv_transfer_params"]["remote_engine_id"] for req in ps[0].requests[1:]]
        assert sorted(offered, key=str) == [None, "d-engine-1"]
        assert registry.get_sample_value("kvdiag_concurrent_turns_total") == 1
        outcomes = sorted(e["outcome"] for e in (await _events_n(tmp_path, 3))[1:])
        assert outcomes == ["concurrent_turn", "unknown"]


async def test_client_disconnect_cancels_decode_and_is_remembered(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, registry=registry) as r:
        ds[0].d_mode, ds[0].d_chunks, ds[0].d_delay = "ok", 50, 0.05
        async with aiohttp.ClientSession() as s:
            resp = await s.post(r.url + CHAT, json=_chat("hi"))
            await resp.content.readany()
            resp.close()  # the client goes away mid-stream
        await wait_for(lambda: ds[0].aborted == 1)
        await wait_for(lambda: registry.get_sample_value("kvdiag_client_disconnects_total") == 1)
        ev = (await _events_n(tmp_path, 1))[0]
        assert ev["status"] == "disconnected" and ev["attrs"]["missing_metadata_reason"] == "client_disconnected"
        ds[0].d_chunks, ds[0].d_delay = 3, 0
        await _post(r.url, _chat("hi", REPLY, "y"))
        ev2 = (await _events_n(tmp_path, 2))[1]
        assert ev2["outcome"] == "metadata_not_returned" and "client_disconnected" in ev2["reason"]


async def test_bad_client_requests_get_400(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r, aiohttp.ClientSession() as s:
        async with s.post(r.url + CHAT, data=b"{nope", headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
        async with s.post(r.url + CHAT, json=_chat("hi", conv={"a": 1})) as resp:  # type: ignore[arg-type]
            assert resp.status == 400
        assert not ps[0].requests


async def test_health_metrics_and_proxy_log(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, proxy_log=log, hash_ids=True) as r:
        _, _, h1 = await _post(r.url, _chat("hi"))
        _, _, h2 = await _post(r.url, _chat("hi", REPLY, "y"))
        await _post(r.url, _chat("hi", conv=None))
        async with aiohttp.ClientSession() as s:
            async with s.get(r.url + "/health") as resp:
                assert await resp.json() == {"status": "ok", "cached_conversations": 1, "evicted_stale": 0}
            async with s.get(r.url + "/metrics") as resp:
                text = await resp.text()
        assert "kvdiag_router_entry_ttl_seconds 450.0" in text
        assert "kvdiag_decoder_kv_blocks_ttl_seconds 480.0" in text
        assert "kvdiag_store_entries 1.0" in text
        assert "conv-1" not in text and h1["X-Request-Id"] not in text  # no ids in labels
        evs = await _events_n(tmp_path, 3)
    lines = log.read_text().splitlines()
    conv = evs[0]["conversation_id"]
    assert conv != "conv-1" and len(conv) == 16 and evs[0]["attrs"]["id_hash"] == "sha256-16"
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    expected = [
        rf"{stamp} \[INFO\] disagg_proxy: Ready: 1 prefill, 1 decode instances",
        rf"{stamp} \[INFO\] disagg_proxy: \[{h1['X-Request-Id']}\] conv={conv}: cache MISS",
        rf"{stamp} \[INFO\] disagg_proxy: \[{h1['X-Request-Id']}\] Prefill done in \d+ms",
        rf"{stamp} \[INFO\] disagg_proxy: conv={conv}: cached D blocks \(remote_request_id=chatcmpl-"
        rf"{h1['X-Request-Id']}-abcd1234, blocks=3\)",
        rf"{stamp} \[INFO\] disagg_proxy: conv={conv}: cache HIT \(age=\d+\.\ds\)",
        rf"{stamp} \[INFO\] disagg_proxy: \[{h2['X-Request-Id']}\] conv={conv}: sending D's cached blocks to P "
        rf"\(remote_request_id=chatcmpl-{h1['X-Request-Id']}-abcd1234\)",
    ]
    for pattern in expected:
        assert any(re.fullmatch(pattern, line) for line in lines), (pattern, lines)
    assert any("[WARNING] disagg_proxy: [" in line and "No conversation_id provided — KV cache reuse disabled"
               in line and line.endswith("(off by default).") for line in lines)


FORGED = "conv=victim: cache HIT (age=1.0s)"


async def test_a_hostile_conversation_id_cannot_forge_a_proxy_log_line(tmp_path: Path) -> None:
    """A client's id with a line break and an escape sequence is logged as its sha256 tag: every line stays one
    record of the example proxy's format, and no line names a conversation the client made up."""
    log = tmp_path / "proxy.log"
    hostile = f"x\n2025-11-29 06:55:00 [INFO] disagg_proxy: {FORGED}\x1b[2J"
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, proxy_log=log) as r:
        _, _, h1 = await _post(r.url, _chat("hi", conv=hostile))
        await _post(r.url, _chat("hi", REPLY, "y", conv=hostile))
        await _post(r.url, _chat("hi", conv="plain-id"))
        evs = await _events_n(tmp_path, 3)
    lines = log.read_text(encoding="utf-8").split("\n")[:-1]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[[A-Z]+\] disagg_proxy: [^\x00-\x1f]*", line)
               for line in lines), lines
    assert not [line for line in lines if "victim" in line]
    tag = hash_conversation_id(hostile)
    assert any(f"[{h1['X-Request-Id']}] conv={tag}: cache MISS" in line for line in lines)
    assert any("conv=plain-id: cache MISS" in line for line in lines)  # a plain id is logged as it is
    # the events (JSON) keep the id as the client sent it
    assert evs[0]["conversation_id"] == hostile and "id_hash" not in evs[0].get("attrs", {})
    # the control: as sent, the id would have written the forged line
    assert not loggable_as_is(hostile) and loggable_as_is("plain-id")


TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-b7ad6b7169203331-01"


async def test_traceparent_is_forwarded_when_tracing_is_off(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        await _post(r.url, _chat("hi"), headers={"traceparent": TRACEPARENT})
        assert ps[0].headers[0]["Traceparent"] == TRACEPARENT == ds[0].headers[0]["Traceparent"]
        assert (await _events_n(tmp_path, 1))[0]["trace_id"] == TRACE


async def test_spans_for_turn_and_legs_and_ttft_exemplars(tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    registry = CollectorRegistry()
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, span_exporter=exporter,
                                                       registry=registry) as r:
        await _post(r.url, _chat("hi"), headers={"traceparent": TRACEPARENT})
        ps[0].p_report = {"v": 1, "engine_request_id": "chatcmpl-x-1", "prompt_tokens": 30, "local_hit_tokens": 0,
                          "remote_offered_tokens": 28, "remote_read_tokens": 28, "computed_tokens": 2,
                          "outcome": "remote_hit", "transfer_bytes": 98304, "transfer_ms": 4.5,
                          "engine_id": "p-engine-1"}
        await _post(r.url, _chat("hi", REPLY, "y"), headers={"traceparent": TRACEPARENT})
        async with aiohttp.ClientSession() as s, s.get(
                r.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = await resp.text()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert {n: len(v) for n, v in by_name.items()} == {"kvdiag.turn": 2, "kvdiag.prefill_leg": 2,
                                                        "kvdiag.decode_leg": 2}
    assert all(format(sp.context.trace_id, "032x") == TRACE for sp in spans)
    turn2 = by_name["kvdiag.turn"][1]
    attrs = dict(turn2.attributes or {})
    assert attrs["kvdiag.turn"] == 2 and attrs["kvdiag.lookup"] == "hit" and attrs["kvdiag.verdict"] == "remote_hit"
    # tokens and bytes from P's usage and per-request report
    assert attrs["gen_ai.usage.prompt_tokens"] == 30
    assert attrs["kvdiag.transfer_bytes"] == 98304 and attrs["kvdiag.remote_read_tokens"] == 28
    assert "kvdiag.transfer_bytes" not in dict(by_name["kvdiag.turn"][0].attributes or {})  # turn 1 read nothing
    assert attrs["kvdiag.conversation"] != "conv-1" and len(str(attrs["kvdiag.conversation"])) == 16
    # P and D see the leg spans as their parents, in the client's trace.
    p_parent = ps[0].headers[1]["Traceparent"].split("-")
    d_parent = ds[0].headers[1]["Traceparent"].split("-")
    assert p_parent[1] == d_parent[1] == TRACE
    assert int(p_parent[2], 16) == by_name["kvdiag.prefill_leg"][1].context.span_id
    assert int(d_parent[2], 16) == by_name["kvdiag.decode_leg"][1].context.span_id
    assert f'trace_id="{TRACE}"' in text and "kvdiag_ttft_seconds_bucket" in text


async def test_spans_reach_an_otlp_http_collector(tmp_path: Path) -> None:
    import http.server
    import threading

    received: list[tuple[str, str, int]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(length)
            received.append((self.path, self.headers.get("Content-Type", ""), length))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path, otlp_endpoint=endpoint) as r:
            await _post(r.url, _chat("hi"))
        # Closing the router flushes the batch exporter.
        assert received and received[0][0] == "/v1/traces" and received[0][1] == "application/x-protobuf"
        assert received[0][2] > 0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_client_closing_right_after_done_is_not_a_disconnect(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds), router_for(ps, ds, tmp_path) as r:
        ds[0].d_linger = 1.0  # D closes its stream late: the client hangs up first
        host, port = r.url.removeprefix("http://").split(":")
        payload = json.dumps(_chat("hi")).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"data: [DONE]"), 10)
        writer.transport.abort()  # hang up the moment the reply is complete, as eager clients do
        ev = (await _events_n(tmp_path, 1))[0]
        assert ev["status"] == "ok" and ev.get("http_status", 200) == 200
        assert ev["attrs"]["stored"] is True
