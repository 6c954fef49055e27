"""The real-engine testbed: ``kvdiag router`` in front of P and D running vLLM's Scheduler + NIXL on CPU.

P and D are ``kvdiag sim prefill|decode --engine vllm`` (one process each: vLLM
0.33.0's real v1 Scheduler, KVDiagNixlConnector in both roles, NIXL/UCX agents, the ZMQ side
channel); the router is the real ``kvdiag router`` CLI. A three-turn conversation must read D's
blocks back on turns 2 and 3 (real NIXL READs) and the router's per-turn events must carry the
bytes and milliseconds P's connector reported.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_harness.testbed import attempt_dirs, real_vllm_testbed, run_retrying_handshake

from kvdiag.schema.events import TurnEvent, read_events
from kvdiag.sim.tokenizer import generate_text

pytestmark = pytest.mark.vllm

BIN = Path(sys.executable).parent
BLOCK_BYTES = 2 * 98_304       # one block, both layers of the OPT-shaped CPU model


def _on_testbed(tmp_path: Path, scenario: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Run ``scenario`` (its checks included) against a fresh testbed; once more in a new folder when vLLM logged
    its own NIXL handshake timeout (a loaded machine, before any kvdiag code runs)."""
    def run(tmp: Path) -> None:
        with real_vllm_testbed(tmp) as bed:
            asyncio.run(scenario({"dir": tmp, "router": bed.router.url, "p": bed.prefill.ready,
                                  "d": bed.decode.ready}))

    run_retrying_handshake(attempt_dirs(tmp_path), run)


async def _turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]]) -> str:
    body = {"model": "Qwen/Qwen3-32B", "messages": messages, "max_tokens": 40, "stream": True,
            "conversation_id": "conv-vllm-1"}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    reply = ""
    for frame in raw.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            for choice in json.loads(frame[6:]).get("choices", []):
                reply += (choice.get("delta") or {}).get("content") or ""
    assert reply
    return reply


def _events(path: Path, n: int, timeout: float = 10.0) -> list[TurnEvent]:
    deadline = time.monotonic() + timeout
    while True:
        evs = list(read_events(path)) if path.exists() else []
        if len(evs) >= n or time.monotonic() > deadline:
            return evs
        time.sleep(0.05)


def test_three_turns_through_the_router_read_d_blocks_back(tmp_path: Path) -> None:
    _on_testbed(tmp_path, _three_turns)


async def _three_turns(testbed: dict[str, Any]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": generate_text(11, 90)}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for turn in (1, 2, 3):
            reply = await _turn(session, testbed["router"], messages)
            if turn < 3:
                messages = [*messages, {"role": "assistant", "content": reply},
                            {"role": "user", "content": generate_text(20 + turn, 12)}]
        async with session.get(f"http://127.0.0.1:{testbed['p']['port']}/metrics") as resp:
            metrics = (await resp.text()).splitlines()
    # P's /metrics: vLLM's own KVConnectorProm with the connector's series and vLLM's labels
    labels = 'engine="0",model_name="Qwen/Qwen3-32B"'
    assert f'kvdiag_connector_requests_total{{{labels},outcome="remote_hit",role="prefill"}} 2.0' in metrics
    assert f"vllm:nixl_bytes_transferred_count{{{labels}}} 2.0" in metrics
    tmp: Path = testbed["dir"]
    router = _events(tmp / "router-events.jsonl", 3)
    assert [e.outcome for e in router] == ["first_turn", "remote_hit", "remote_hit"]
    p_events = {e.engine_request_id: e for e in _events(tmp / "prefill-events.jsonl", 4)
                if e.event == "prefill_request"}
    d_events = _events(tmp / "decode-events.jsonl", 6)
    retained = {e.engine_request_id: e for e in d_events if e.event == "kv_retained"}
    released = {e.engine_request_id: e.release_reason for e in d_events if e.event == "kv_released"}
    for ev in router[1:]:
        p_ev = p_events[ev.engine_request_id]     # what P's connector reported for this turn
        assert p_ev.outcome == "remote_hit" and p_ev.status == "ok"
        assert (ev.transfer_bytes, ev.transfer_ms) == (p_ev.transfer_bytes, p_ev.transfer_ms)
        assert ev.remote_read_tokens == p_ev.remote_read_tokens == p_ev.remote_offered_tokens > 0
        # a real NIXL READ of every block D held for the previous turn, and D freed them on P's notification
        held = retained[p_ev.remote_request_id]
        assert held.retained_blocks == math.ceil(p_ev.remote_offered_tokens / 32)
        assert p_ev.transfer_bytes == held.retained_blocks * BLOCK_BYTES and p_ev.transfer_ms > 0
        assert released[p_ev.remote_request_id] == "read"


def test_a_cut_handle_is_read_exactly_and_the_turn_succeeds(tmp_path: Path) -> None:
    _on_testbed(tmp_path, _cut_handle)


async def _cut_handle(testbed: dict[str, Any]) -> None:
    # A regenerate (the same prompt again: D's sequence is longer than it) and an edited reply: the router
    # cuts D's handle to the previous prompt's whole blocks; real vLLM reads exactly those blocks over
    # NIXL, computes the rest and answers.
    first = [{"role": "user", "content": generate_text(31, 150)}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        reply = await _turn(session, testbed["router"], first)
        await _turn(session, testbed["router"], first)                      # regenerate
        edited = [*first, {"role": "assistant", "content": reply + " (edited by the client)"},
                  {"role": "user", "content": generate_text(32, 12)}]
        await _turn(session, testbed["router"], edited)                     # reply edited
    tmp: Path = testbed["dir"]
    router = _events(tmp / "router-events.jsonl", 3)
    assert [e.trim_reason for e in router] == [None, "reply_absent", "reply_edited"]
    p_events = {e.engine_request_id: e for e in _events(tmp / "prefill-events.jsonl", 4)
                if e.event == "prefill_request"}
    for ev in router[1:]:
        limit, held = ev.reuse_limit_tokens, ev.handle_tokens
        assert limit is not None and held is not None and 0 < limit < held and limit % 32 == 0
        assert ev.trimmed_tokens == held - limit and ev.status == "ok" and ev.outcome == "remote_hit"
        p_ev = p_events[ev.engine_request_id]
        # P (prefix caching off) read exactly the cut handle's blocks and found them all matching.
        assert p_ev.remote_offered_tokens == limit and p_ev.remote_read_tokens == limit
        assert not p_ev.mismatch_tokens and p_ev.status == "ok"
        assert p_ev.transfer_bytes == limit // 32 * BLOCK_BYTES
        assert p_ev.computed_tokens == p_ev.prompt_tokens - limit
