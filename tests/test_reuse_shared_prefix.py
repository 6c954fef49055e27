"""A prompt that diverges at a message boundary no turn ended at: the router learns that prefix's token count.

The rule's clean boundaries (the end of the system prompt, a user query) are checked against the
sim's Qwen3-like template and tokenizer; then, through a real router in front of the emulated P
and D on loopback (P's own block-hash check off, so only the router stands between P and wrong
KV), an edited first user message reuses the system prompt's blocks with no wrong KV; a failing or
slow /tokenize falls back to the turn boundaries and is counted; and the negative controls show
that counting past the clean boundary (the edited message itself, or a prefix ending with an
assistant message) loads wrong KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_support import read_jsonl, wait_for

from kvdiag.router import reuse_rule, shared_prefix
from kvdiag.router.app import start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.router.reuse_rule import Coverage, Decision, Reuse, Rung, next_rungs, prompt_view
from kvdiag.schema.verdicts import TrimReason
from kvdiag.sim.chat_template import render_text
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import start_engine
from kvdiag.sim.tokenizer import random_words, tokenize

MODEL = "Qwen/Qwen3-32B"
SYSTEM = "You are a careful reviewer of router designs. Answer briefly, cite the code. " * 12
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


# ---------------------------------------------------------------------------------------------- the template
def _conversation(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": random_words(rng, rng.randint(5, 40))}]
    for _ in range(turns):
        messages.append({"role": "user", "content": random_words(rng, rng.randint(3, 30))})
        reply: dict[str, Any] = {"role": "assistant", "content": random_words(rng, rng.randint(3, 30))}
        if rng.random() < 0.5:
            reply["reasoning_content"] = random_words(rng, rng.randint(3, 20))
        if rng.random() < 0.3:
            reply["tool_calls"] = [{"id": "c", "type": "function",
                                    "function": {"name": "lookup", "arguments": json.dumps({"q": "x"})}}]
            messages.append(reply)
            messages.append({"role": "tool", "tool_call_id": "c", "content": random_words(rng, 5)})
            messages.append({"role": "tool", "tool_call_id": "c", "content": random_words(rng, 5)})
            continue
        messages.append(reply)
    return messages


@pytest.mark.parametrize("seed", range(40))
def test_a_clean_boundary_renders_as_a_token_prefix_of_every_longer_prompt(seed: int) -> None:
    rng = random.Random(seed)
    tools = TOOLS if seed % 2 else None
    messages = _conversation(rng, rng.randint(1, 6))
    messages.append({"role": "user", "content": random_words(rng, 8)})
    view = prompt_view({"messages": messages})
    assert view is not None and view.clean and view.head == 1
    for p in view.clean:
        prefix = tokenize(render_text(messages[:p], add_generation_prompt=False, tools=tools))
        # every longer prompt starting with these messages, as a next turn sends it (generation prompt on)
        for end in range(p + 1, len(messages) + 1):
            longer = tokenize(render_text(messages[:end], tools=tools))
            assert longer[:len(prefix)] == prefix, (seed, p, end)


def test_a_prefix_ending_with_an_assistant_message_is_not_clean() -> None:
    # Qwen3 renders the final assistant message after the last query with a <think> block, which the
    # same message loses once anything follows it: that prefix's count overshoots the shared tokens.
    messages = [{"role": "system", "content": "sys words"}, {"role": "user", "content": "a question"},
                {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "next"}]
    view = prompt_view({"messages": messages})
    assert view is not None and view.clean == (1, 2)  # not 3
    prefix = tokenize(render_text(messages[:3], add_generation_prompt=False))
    longer = tokenize(render_text(messages))
    assert longer[:len(prefix)] != prefix


def test_clean_boundaries_are_kept_without_a_count_and_the_system_prompt_s_end_outlives_the_rest() -> None:
    messages = [{"role": "system", "content": "s"}]
    for i in range(30):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    messages.append({"role": "user", "content": "last"})
    view = prompt_view({"messages": messages})
    assert view is not None
    rungs = next_rungs(None, None, view, 900, clean=True)
    assert len(rungs) == reuse_rule.MAX_RUNGS and rungs[0] == Rung(1, view.digests[1], None)
    assert all(r.tokens is None and r.query for r in rungs[1:-1]) and rungs[-1].tokens == 900
    assert next_rungs(None, None, view, 900) == (Rung(len(messages), view.digest, 900, query=True),)


def test_which_boundary_to_learn() -> None:
    old = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "q2"}]
    view_old = prompt_view({"messages": old})
    assert view_old is not None
    coverage = Coverage(reuse_rule.CHAT, next_rungs(None, None, view_old, 40, clean=True), None, last_query=3)
    edited = [old[0], {"role": "user", "content": "q1 edited"}]
    view = prompt_view({"messages": edited}, coverage.lengths())
    assert view is not None
    decision = reuse_rule.decide(coverage, view, handle_tokens=50, block_size=16)
    assert decision.reuse is Reuse.NONE and decision.matched == 0
    assert shared_prefix.boundary_to_learn(coverage, view, decision) == 0
    assert shared_prefix.consistent(coverage, 0, 20) and not shared_prefix.consistent(coverage, 0, 41)
    assert not shared_prefix.consistent(coverage, 0, 0)
    learned = shared_prefix.with_count(coverage, 0, 37)
    again = reuse_rule.decide(learned, view, handle_tokens=50, block_size=16)
    assert again.reuse is Reuse.TRIMMED and again.limit_tokens == 16 and again.reason is TrimReason.HISTORY_EDITED
    assert shared_prefix.boundary_to_learn(learned, view, again) is None  # nothing above it left to learn
    # the previous prompt reproduced: the rule needs no count
    same = prompt_view({"messages": [*old, {"role": "assistant", "content": "b"}]}, coverage.lengths())
    assert same is not None
    assert shared_prefix.boundary_to_learn(coverage, same, reuse_rule.decide(coverage, same, handle_tokens=50,
                                                                             block_size=16)) is None
    unknown = Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE, matched=0)
    assert shared_prefix.boundary_to_learn(coverage, view, unknown) is None


def test_the_tokenize_request_renders_the_shared_messages_alone() -> None:
    body = {"model": MODEL, "messages": [], "tools": TOOLS, "stream": True, "chat_template_kwargs": {"x": 1},
            "add_generation_prompt": True, "continue_final_message": False, "max_tokens": 5}
    out = shared_prefix.tokenize_prefix_body(body, [{"role": "system", "content": "s"}])
    assert out == {"model": MODEL, "tools": TOOLS, "chat_template_kwargs": {"x": 1},
                   "messages": [{"role": "system", "content": "s"}], "add_generation_prompt": False}
    assert shared_prefix.tokenize_prefix_body({**body, "reasoning_effort": "low"}, []) is None
    assert shared_prefix.tokenize_prefix_body({**body, "tool_choice": {"type": "function"}}, []) is None


# ---------------------------------------------------------------------------------------------- the router
class TokenizeFront:
    """A real HTTP front for the emulated P: everything passes through, /tokenize fails or stalls on demand."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.mode = "pass"  # pass | fail | slow
        self.calls = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        if request.path == "/tokenize":
            self.calls += 1
            if self.mode == "fail":
                return web.json_response({"error": {"message": "boom", "type": "InternalServerError"}}, status=500)
            if self.mode == "slow":
                await asyncio.sleep(1.0)
        async with self._session.request(request.method, self.target + request.path_qs, data=await request.read(),
                                         headers={"Content-Type": request.headers.get("Content-Type", "")}) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type=resp.content_type)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


@contextlib.asynccontextmanager
async def stack(tmp: Path, parsers: bool = False, **router_kw: Any) -> AsyncIterator[tuple[Any, Path, TokenizeFront]]:
    tmp.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {"reasoning_parser": "qwen3"} if parsers else {}
    p = await start_engine(EngineConfig(role="prefill", time_scale=0, mode="instrumented", prefix_caching=False,
                                        prefix_digest=False, pull_matching_prefix=False, block_size=16,
                                        kv_recompute_threshold=16, **options))
    d = await start_engine(EngineConfig(role="decode", time_scale=0, mode="instrumented", block_size=16, **options))
    front = TokenizeFront(p.url)
    await front.start()
    events = tmp / "router-events.jsonl"
    router = await start_router(RouterConfig(prefill=(Upstream("127.0.0.1", front.port),),
                                             decode=(Upstream("127.0.0.1", d.port),), host="127.0.0.1", port=0,
                                             events_file=events, block_size=16, **router_kw))
    try:
        yield router, events, front
    finally:
        await router.close()
        await front.close()
        await p.close()
        await d.close()


async def _send(session: aiohttp.ClientSession, url: str, conv: str, messages: list[dict[str, Any]],
                **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 96, "conversation_id": conv, **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw[:300]
    msg = json.loads(raw)["choices"][0]["message"]
    out = {"role": "assistant", "content": msg.get("content")}
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if reasoning:
        out["reasoning_content"] = reasoning  # sent back, as some agent clients do
    return out


async def _edit_first_user(session: aiohttp.ClientSession, url: str, conv: str) -> None:
    """Two turns, then the first user message edited (only the system prompt stays in common)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "Review the router's reuse rule. " * 4}]
    reply = await _send(session, url, conv, messages)
    messages += [reply, {"role": "user", "content": "And its limits?"}]
    await _send(session, url, conv, messages)
    await _send(session, url, conv, [messages[0], {"role": "user", "content": "Review the store instead. " * 5}])


def _turns(events: Path, conv: str) -> list[dict[str, Any]]:
    return sorted((e for e in read_jsonl(events) if e["conversation_id"] == conv), key=lambda e: e["turn"])


async def _metric(session: aiohttp.ClientSession, url: str, outcome: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(f'kvdiag_reuse_shared_prefix_counts_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_an_edited_first_user_message_reuses_the_system_prompt_s_blocks(tmp_path: Path) -> None:
    system_tokens = len(tokenize(render_text([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    async with stack(tmp_path) as (router, events, front), aiohttp.ClientSession() as session:
        await _edit_first_user(session, router.url, "a")
        await _edit_first_user(session, router.url, "b")  # the same system prompt: the count is cached
        await wait_for(lambda: len(read_jsonl(events)) >= 6)
        a, b = _turns(events, "a"), _turns(events, "b")
        assert front.calls == 1
        assert await _metric(session, router.url, "tokenized") == 1
        assert await _metric(session, router.url, "cached") == 1
    assert all(e.get("wrong_kv_tokens", 0) == 0 for e in a + b)
    edited = a[2]
    assert edited["attrs"]["shared_prefix"] == "tokenized" and b[2]["attrs"]["shared_prefix"] == "cached"
    assert edited["trim_reason"] == "history_edited" and edited["outcome"] == "remote_hit"
    expected = (system_tokens - 8) // 16 * 16
    assert expected >= 64
    assert edited["reuse_limit_tokens"] == expected and edited["remote_read_tokens"] == expected
    assert "shared_prefix" not in a[1]["attrs"]  # a clean continuation asks nothing


async def test_without_the_option_an_edited_first_user_message_reuses_nothing(tmp_path: Path) -> None:
    async with stack(tmp_path, tokenize_shared_prefix=False) as (router, events, front), \
            aiohttp.ClientSession() as session:
        await _edit_first_user(session, router.url, "a")
        await wait_for(lambda: len(read_jsonl(events)) >= 3)
        edited = _turns(events, "a")[2]
    assert front.calls == 0 and edited["reuse_limit_tokens"] == 0 and edited["outcome"] == "prefix_mismatch"


@pytest.mark.parametrize("mode", ["fail", "slow"])
async def test_a_failed_or_slow_tokenize_falls_back_and_is_counted(tmp_path: Path, mode: str) -> None:
    async with stack(tmp_path, shared_prefix_timeout=0.3) as (router, events, front), \
            aiohttp.ClientSession() as session:
        front.mode = mode
        await _edit_first_user(session, router.url, "a")
        await wait_for(lambda: len(read_jsonl(events)) >= 3)
        edited = _turns(events, "a")[2]
        outcome = "failed" if mode == "fail" else "timeout"
        assert await _metric(session, router.url, outcome) == 1
    assert front.calls == 1
    assert edited["attrs"]["shared_prefix"] == outcome
    assert edited["outcome"] == "prefix_mismatch" and edited["reuse_limit_tokens"] == 0  # today's behaviour
    assert edited["status"] == "ok" and edited.get("wrong_kv_tokens", 0) == 0
    if mode == "slow":
        assert edited["attrs"]["shared_prefix_ms"] < 900


async def test_negative_control_counting_the_edited_message_loads_wrong_kv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = shared_prefix.tokenize_prefix_body

    def one_message_too_many(body: Any, messages: list[Any]) -> Any:
        return original(body, list(body["messages"][:len(messages) + 1]))

    monkeypatch.setattr(shared_prefix, "tokenize_prefix_body", one_message_too_many)
    async with stack(tmp_path) as (router, events, _front), aiohttp.ClientSession() as session:
        await _edit_first_user(session, router.url, "a")
        await wait_for(lambda: len(read_jsonl(events)) >= 3)
        edited = _turns(events, "a")[2]
    assert edited["attrs"]["shared_prefix"] == "tokenized" and edited["wrong_kv_tokens"] > 0


async def test_negative_control_a_prefix_ending_with_an_assistant_message_loads_wrong_kv(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every message boundary taken as clean: the edit of the second user message falls back to the
    # end of the reasoning model's reply before it (its trace sent back), whose rendering alone keeps
    # the trace (the final message after the last query) while every longer prompt drops it.
    original = reuse_rule.prompt_view

    def every_boundary_clean(body: Any, lengths: Any = ()) -> Any:
        view = original(body, [*lengths, *range(1, len(body.get("messages") or []))])
        return None if view is None else reuse_rule.PromptView(
            view.kind, view.length, view.digest, view.digests, view.messages, view.first_reasoning,
            view.reasoning_at, view.last_query, tuple(range(1, view.length)), view.head)

    monkeypatch.setattr(reuse_rule, "prompt_view", every_boundary_clean)
    monkeypatch.setattr("kvdiag.router.flow.prompt_view", every_boundary_clean)
    edited = await _edit_after_reasoning(tmp_path)
    assert edited["attrs"]["shared_prefix"] == "tokenized" and edited["wrong_kv_tokens"] > 0


async def test_the_same_edit_through_the_unpatched_router_loads_no_wrong_kv(tmp_path: Path) -> None:
    edited = await _edit_after_reasoning(tmp_path)
    assert "shared_prefix" not in edited["attrs"]  # the reply's end is no clean boundary: nothing learned
    assert edited.get("wrong_kv_tokens", 0) == 0 and edited["reuse_limit_tokens"] > 0  # the turn-1 boundary


async def _edit_after_reasoning(tmp: Path) -> dict[str, Any]:
    hint = {"kvdiag_sim": {"reasoning_tokens": 60, "content_tokens": 20}}
    async with stack(tmp, parsers=True) as (router, events, _front), aiohttp.ClientSession() as session:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "Review the router's reuse rule. " * 4}]
        reply = await _send(session, router.url, "a", messages, **hint)
        # (a long question: the turn's count stays above the overshooting one, which the consistency check
        # would refuse otherwise)
        messages += [reply, {"role": "user", "content": "And its limits? " * 40}]
        await _send(session, router.url, "a", messages, **hint)
        await _send(session, router.url, "a", [*messages[:3], {"role": "user", "content": "And its costs? " * 3}],
                    **hint)
        await wait_for(lambda: len(read_jsonl(events)) >= 3)
        return _turns(events, "a")[2]
