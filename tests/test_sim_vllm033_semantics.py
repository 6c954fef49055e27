"""The emulated engines against vLLM 0.33's own semantics, over real sockets.

* A request vLLM finishes with ``finish_reason`` error (a KV load failure under policy ``fail``)
  answers as 0.33's serving layer does: a full response is HTTP 500 with the error object, a stream
  is HTTP 200 with the chat role chunk, the error object as a chunk, then ``[DONE]``; the API server
  logs ``Request <id> failed with an internal error during generation``.
* NIXL's counts as ``NixlKVConnectorStats`` keeps them: a declined (expiring) read is an expiry, not a
  failed transfer; handshake and notification failures are failed transfers; a notification for
  blocks no longer held is a ``notification after expiry`` on the owner, in the log line and in
  ``vllm:nixl_num_notifications_after_expiry``.
* The ``KV Transfer metrics`` line follows its ``Engine`` line; ``Transfer plan`` is logged at the
  handshake, right after the compatibility check.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvdiag.sim.config import EngineConfig
from kvdiag.sim.pd_driver import TurnResult, run_turn
from kvdiag.sim.server import EngineHandle, start_engine
from kvdiag.sim.tokenizer import generate_text

Factory = Callable[..., Awaitable[EngineHandle]]
STOCK_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
KV_LINE = re.compile(r"\[metrics\.py:108\] KV Transfer metrics: (.*)$")


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[Factory]:
    started: list[EngineHandle] = []

    async def make(role: str, **kw: Any) -> EngineHandle:
        kw.setdefault("time_scale", 0.0)
        kw.setdefault("log_file", str(tmp_path / f"{role}.log"))
        kw.setdefault("log_level", "INFO")
        kw.setdefault("mode", "stock")
        kw.setdefault("log_stats_interval_s", 0.05)
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


def _msgs() -> list[dict[str, Any]]:
    return [{"role": "user", "content": generate_text(5, 120)}]


def _next(messages: list[dict[str, Any]], turn: TurnResult) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": turn.reply}, {"role": "user", "content": generate_text(9, 80)}]


async def _faults(session: aiohttp.ClientSession, url: str, changes: dict[str, Any]) -> None:
    async with session.post(f"{url}/kvdiag/admin/faults", json=changes) as resp:
        assert resp.status == 200, await resp.text()


def _kv_lines(path: Path) -> list[dict[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        m = KV_LINE.search(line)
        if m:
            out.append(dict(p.split("=", 1) for p in m.group(1).split(", ")))
    return out


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        return await resp.text()


async def _raw_stream(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with session.post(url + path, json=body, headers={"X-Request-Id": "stream-err"}) as resp:
        return resp.status, await resp.read()


async def _p_leg(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """P's prefill alone; its params for D (without P's report)."""
    async with session.post(url + path, json={**body, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True}}) as resp:
        params = (await resp.json())["kv_transfer_params"]
    assert isinstance(params, dict)
    return {k: v for k, v in params.items() if k != "kvdiag"}


@pytest.mark.parametrize("mode", ["stock", "instrumented"])
async def test_kv_load_failure_answers_as_the_api_server(engines: Factory, session: aiohttp.ClientSession,
                                                         tmp_path: Path, mode: str) -> None:
    p = await engines("prefill", prefix_caching=False, mode=mode)
    d = await engines("decode", mode=mode)
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "shape-t1")
    await _faults(session, p.url, {"fail_transfers": {"transfer_failed": 1.0}})
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "shape-t2")
    assert t2.p_status == 500 and set(t2.p_body) == {"error"}
    error = dict(t2.p_body["error"])
    report = error.pop("kvdiag", None)
    assert error == STOCK_ERROR
    # instrumented: P's outcome in the error object (stock consumers read the status, not the object)
    assert (report is not None and report["outcome"] == "transfer_failed") == (mode == "instrumented")
    assert re.search(r"^\(APIServer pid=\d+\) ERROR .* \[serving\.py:203\] Request chatcmpl-shape-t2 failed with an "
                     r"internal error during generation$", (tmp_path / "prefill.log").read_text(), re.M)

    # D's own P->D read fails: streamed, the 200 carries the role chunk, the error object, [DONE]
    fresh = [{"role": "user", "content": generate_text(31, 120)}]  # nothing of it in D's prefix cache
    await _faults(session, p.url, {"fail_transfers": {}})
    await _faults(session, d.url, {"fail_transfers": {"transfer_failed": 1.0}})
    d_params = await _p_leg(session, p.url, "/v1/chat/completions", {"messages": fresh})
    status, raw = await _raw_stream(session, d.url, "/v1/chat/completions", {
        "messages": fresh, "max_tokens": 8, "stream": True, "kv_transfer_params": d_params})
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert status == 200 and len(frames) == 3, frames
    assert '"delta":{"role":"assistant","content":""}' in frames[0]
    assert frames[1] == 'data: {"error":{"message":"Internal server error","type":"InternalServerError",' \
                        '"param":null,"code":500}}'
    assert frames[2] == "data: [DONE]"
    # completions: no role chunk
    prompt = generate_text(41, 120)
    d_params = await _p_leg(session, p.url, "/v1/completions", {"prompt": prompt})
    status, raw = await _raw_stream(session, d.url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 8, "stream": True, "kv_transfer_params": d_params})
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert status == 200 and [f[:16] for f in frames] == ['data: {"error":{', "data: [DONE]"], frames


async def test_declined_read_is_an_expiry_not_a_failed_transfer(engines: Factory, session: aiohttp.ClientSession,
                                                                tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode", decoder_kv_blocks_ttl=4.0)  # inside vLLM's 5 s margin: declined at once
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "dec-t1")
    t2 = await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "dec-t2")
    assert t2.p_status == 500
    await asyncio.sleep(0.2)
    lines = _kv_lines(tmp_path / "prefill.log")
    assert [(x["Num failed transfers"], x["Num KV expired reqs"]) for x in lines] == [("0", "1")], lines
    text = await _metrics(session, p.url)
    assert _counter(text, "vllm:nixl_num_kv_expired_reqs_total") == 1.0
    assert _counter(text, "vllm:nixl_num_failed_transfers_total") == 0.0


@pytest.mark.parametrize(("failure", "notifications"), [("notification_failed", 1.0), ("handshake_failed", 0.0)])
async def test_handshake_and_notification_failures_count_as_failed_transfers(
        engines: Factory, session: aiohttp.ClientSession, tmp_path: Path, failure: str, notifications: float) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "nf-t1")
    await _faults(session, p.url, {"fail_transfers": {failure: 1.0}})
    await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "nf-t2")
    await asyncio.sleep(0.2)
    # (a failed request adds no throughput: its interval is at INFO only beside turn 1's work, as in vLLM)
    lines = _kv_lines(tmp_path / "prefill.log")
    assert sum(int(x["Num failed transfers"]) for x in lines) == 1, lines
    text = await _metrics(session, p.url)
    assert _counter(text, "vllm:nixl_num_failed_transfers_total") == 1.0
    assert _counter(text, "vllm:nixl_num_failed_notifications_total") == notifications


async def test_read_of_released_blocks_counts_a_notification_after_expiry(
        engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "late-t1")
    await asyncio.sleep(0.2)
    text = await _metrics(session, d.url)
    assert _counter(text, "vllm:nixl_num_notifications_after_expiry_total") == 0.0  # exposed from the start
    async with session.post(f"{d.url}/kvdiag/admin/evict") as resp:
        assert (await resp.json())["evicted"] == 1
    await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "late-t2")
    await asyncio.sleep(0.2)
    d_log = (tmp_path / "decode.log").read_text()
    assert "Potentially invalid KV blocks for unrecognized request" in d_log
    assert [x["Num notifs after expiry"] for x in _kv_lines(tmp_path / "decode.log")][-1:] == ["1"]
    text = await _metrics(session, d.url)
    assert _counter(text, "vllm:nixl_num_notifications_after_expiry_total") == 1.0


async def test_line_order_as_vllm_writes_it(engines: Factory, session: aiohttp.ClientSession, tmp_path: Path) -> None:
    p = await engines("prefill", prefix_caching=False)
    d = await engines("decode")
    msgs = _msgs()
    t1 = await run_turn(session, p.url, d.url, msgs, None, "ord-t1")
    await run_turn(session, p.url, d.url, _next(msgs, t1), t1.d_params, "ord-t2")
    await asyncio.sleep(0.2)
    lines = (tmp_path / "prefill.log").read_text().splitlines()
    kv = [i for i, ln in enumerate(lines) if "KV Transfer metrics: " in ln]
    assert kv and all("] Engine 000: " in lines[i - 1] for i in kv), lines
    compat = next(i for i, ln in enumerate(lines) if "NIXL compatibility check passed" in ln)
    assert "] Transfer plan: TransferTopology(tp_ratio=1, " in lines[compat + 1]
    assert compat + 1 < kv[0]  # logged at the handshake, before the interval that counts the read
    engine_lines = [ln for ln in lines if "] Engine 000: " in ln]
    assert all("Prefix cache hit rate" not in ln for ln in engine_lines)  # P without prefix caching
    assert "External prefix cache hit rate: " in engine_lines[0]  # every request asks the connector
