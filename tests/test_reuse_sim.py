"""End to end with the emulated engines: agent traffic through ``kvdiag router`` never loads wrong KV.

The sim's D writes Qwen3-shaped replies (a reasoning trace, tool calls in the model's own compact
JSON) through vLLM's parsers, its chat template re-renders history the way Qwen3's does, and its P
counts the prompt positions it loaded KV for from other token ids (``wrong_kv_tokens``, the oracle),
with its own block-hash protection off so that only the router's rule stands between the two.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from router_support import read_jsonl, wait_for

from kvdiag.router import reuse, reuse_rule
from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import start_engine

MODEL = "Qwen/Qwen3-32B"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    "reasoning": {"kvdiag_sim": {"reasoning_tokens": 12, "content_tokens": 10}},
    "hidden_reasoning": {"kvdiag_sim": {"reasoning_tokens": 12, "content_tokens": 10}, "include_reasoning": False},
    "tool_call": {"kvdiag_sim": {"tool_calls": 1, "tool_arg_tokens": 6}, "tools": TOOLS, "tool_choice": "auto"},
}


@contextlib.asynccontextmanager
async def sim_router(tmp: Path, parsers: bool, **router_kw: Any) -> AsyncIterator[tuple[RouterHandle, Path]]:
    """P and D (with vLLM's reasoning and tool parsers when ``parsers``) behind a router."""
    tmp.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
                               "enable_auto_tool_choice": True} if parsers else {}
    p = await start_engine(EngineConfig(role="prefill", time_scale=0, mode="instrumented", prefix_caching=False,
                                        prefix_digest=False, pull_matching_prefix=False, **options))
    d = await start_engine(EngineConfig(role="decode", time_scale=0, mode="instrumented", **options))
    events = tmp / "router-events.jsonl"
    router = await start_router(RouterConfig(prefill=(Upstream("127.0.0.1", p.port),),
                                             decode=(Upstream("127.0.0.1", d.port),), host="127.0.0.1", port=0,
                                             events_file=events, **router_kw))
    try:
        yield router, events
    finally:
        await router.close()
        await p.close()
        await d.close()


async def _conversation(session: aiohttp.ClientSession, url: str, conv: str, extra: dict[str, Any],
                        turns: int = 3) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Review this router design, its trade-offs. " * 12}]
    for n in range(turns):
        body = {"model": MODEL, "messages": messages, "max_tokens": 64, "stream": n % 2 == 0,
                "conversation_id": conv, **extra}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
            assert resp.status == 200, raw[:300]
        reply = _reply(raw, bool(body["stream"]))
        messages = [*messages, reply]
        if reply.get("tool_calls"):
            messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "found: 42"})
        else:
            messages.append({"role": "user", "content": f"Go on with point {n + 2}."})


def _reply(raw: bytes, stream: bool) -> dict[str, Any]:
    """The assistant message as an agent sends it back: content and tool calls, never the reasoning."""
    if not stream:
        msg = json.loads(raw)["choices"][0]["message"]
        out = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            out["tool_calls"] = msg["tool_calls"]
        return out
    content, calls = "", {}
    for frame in raw.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        for choice in json.loads(frame[6:]).get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = slot["id"] or tc.get("id")
                slot["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                slot["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
    out = {"role": "assistant", "content": content or None}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


async def _run(tmp: Path, **router_kw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for parsers, names in ((False, ["plain"]), (True, [n for n in SCENARIOS if n != "plain"])):
        async with sim_router(tmp / str(parsers), parsers, **router_kw) as (router, events), \
                aiohttp.ClientSession() as session:
            for name in names:
                await _conversation(session, router.url, name, SCENARIOS[name])
            await wait_for(lambda: len(read_jsonl(events)) >= 3 * len(names))  # noqa: B023 - awaited here
            out += read_jsonl(events)
    return out


async def test_agent_traffic_through_the_router_loads_no_wrong_kv(tmp_path: Path) -> None:
    events = await _run(tmp_path)
    later = [e for e in events if e["turn"] > 1]
    assert len(later) == 2 * len(SCENARIOS)
    assert all(e.get("wrong_kv_tokens", 0) == 0 for e in events), [(e["conversation_id"], e.get("wrong_kv_tokens"))
                                                                   for e in events]
    assert all(e["reuse_limit_tokens"] > 0 and e["remote_read_tokens"] > 0 for e in later)  # still reused
    by_conv = {e["conversation_id"]: e for e in later}
    assert "trim_reason" not in by_conv["plain"]
    assert by_conv["reasoning"]["trim_reason"] == "reasoning_stripped"
    assert by_conv["hidden_reasoning"]["trim_reason"] == "reasoning_hidden"
    # The sim's Qwen3 parser also streams a "\n\n" reasoning delta before a tool call: both reasons hold.
    first_tool_turn = next(e for e in events if e["conversation_id"] == "tool_call" and e["turn"] == 1)
    assert "tool_call_rerendered" in first_tool_turn["attrs"]["reply_not_reusable"]
    assert by_conv["tool_call"]["trim_reason"] in ("tool_call_rerendered", "reasoning_stripped")


async def test_negative_control_a_full_handle_rule_loads_wrong_kv_in_the_sim(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "decide", lambda coverage, view, **kw: reuse_rule.Decision(reuse_rule.Reuse.FULL,
                                                                                          kw["handle_tokens"]))
    events = await _run(tmp_path)
    wrong = {e["conversation_id"]: e.get("wrong_kv_tokens", 0) for e in events if e["turn"] > 1}
    assert wrong["plain"] == 0 and all(wrong[name] > 0 for name in ("reasoning", "hidden_reasoning", "tool_call"))


async def test_token_exact_mode_on_the_sim_reuses_at_least_the_text_rule_and_loads_no_wrong_kv(
        tmp_path: Path) -> None:
    text = {(e["conversation_id"], e["turn"]): e for e in await _run(tmp_path / "text")}
    exact = await _run(tmp_path / "exact", verify_tokens=True)
    later = [e for e in exact if e["turn"] > 1]
    assert all(e.get("wrong_kv_tokens", 0) == 0 for e in exact)
    # vLLM hides token ids with include_reasoning false: no trace, the text rule decides.
    assert all(("verified_tokens" in e["attrs"]) == (e["conversation_id"] != "hidden_reasoning") for e in later)
    assert not any(e["attrs"].get("verify_mismatch_after_read") for e in later)  # /tokenize renders like P
    for e in later:
        assert e["reuse_limit_tokens"] >= text[(e["conversation_id"], e["turn"])]["reuse_limit_tokens"]
    assert any(e["reuse_limit_tokens"] > text[(e["conversation_id"], e["turn"])]["reuse_limit_tokens"]
               for e in later)  # the tokens prove more than the text rule (up to the first re-rendered token)
