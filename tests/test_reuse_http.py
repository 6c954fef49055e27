"""vLLM's reference-proxy behaviours over HTTP against ``kvdiag router``, streaming and not.

A vLLM-shaped stub (router_support.VllmStub) plays P and D: it renders prompts like Qwen3's chat
template, streams reasoning / tool-call / refusal deltas as vLLM 0.33 does, and for every prefill
says how many positions P would have loaded KV for from other tokens (vLLM's positional, end-trimmed
read). The client is the real openai SDK. Each case asserts the exact ``remote_num_tokens`` and
``remote_block_ids`` P received; a negative control shows that a rule injecting the full handle
fails the same checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry
from router_support import BLOCK, Reply, VllmStub, prompt_tokens_of, read_jsonl, redis_server, wait_for

from kvdiag.router import reuse, reuse_rule
from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.schema.events import read_events

MODEL = "Qwen/Qwen3-32B"
QUESTION = "Please explain how the prefill and decode stages share the KV cache across turns. " * 4
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
MARGIN = 8


@dataclass
class Bed:
    stub: VllmStub
    router: RouterHandle
    client: openai.AsyncOpenAI
    tmp: Path
    registry: CollectorRegistry

    def events(self) -> list[dict[str, Any]]:
        path = self.tmp / "router-events.jsonl"
        if path.exists():
            list(read_events(path))  # schema-valid, or it raises
        return read_jsonl(path)

    async def event(self, n: int) -> dict[str, Any]:
        await wait_for(lambda: len(self.events()) >= n)
        return self.events()[n - 1]

    async def chat(self, messages: list[dict[str, Any]], conv: str, stream: bool, **extra: Any) -> dict[str, Any]:
        """One chat turn through the router; returns the assistant message as the client saw it."""
        kw: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 64,
                              "extra_body": {"conversation_id": conv, **extra.pop("extra_body", {})}, **extra}
        if not stream:
            resp = await self.client.chat.completions.create(**kw)
            return resp.choices[0].message.model_dump()
        content, reasoning, calls = "", "", {}
        async for chunk in await self.client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
                for tc in delta.get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                    slot["function"]["name"] += (tc.get("function") or {}).get("name") or ""
                    slot["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        return {"role": "assistant", "content": content, "reasoning": reasoning or None,
                "tool_calls": [calls[i] for i in sorted(calls)] or None}

    async def completion(self, prompt: str, conv: str, stream: bool) -> str:
        kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 64,
                              "extra_body": {"conversation_id": conv}}
        if not stream:
            return (await self.client.completions.create(**kw)).choices[0].text
        text = ""
        async for chunk in await self.client.completions.create(stream=True, **kw):
            text += "".join(c.text for c in chunk.choices)
        return text


@contextlib.asynccontextmanager
async def bed_for(tmp: Path, **router_kw: Any) -> AsyncIterator[Bed]:
    tmp.mkdir(parents=True, exist_ok=True)
    stub = await VllmStub().start()
    registry = CollectorRegistry()
    config = RouterConfig(prefill=(Upstream("127.0.0.1", stub.port),), decode=(Upstream("127.0.0.1", stub.port),),
                          host="127.0.0.1", port=0, events_file=tmp / "router-events.jsonl",
                          proxy_log=tmp / "proxy.log", **router_kw)
    router = await start_router(config, registry=registry)
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="test-key", max_retries=0)
    try:
        yield Bed(stub, router, client, tmp, registry)
    finally:
        await client.close()
        await router.close()
        await stub.close()


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[Bed]:
    async with bed_for(tmp_path) as b:
        yield b


def _expected_trim(prompt_tokens: int, handle_tokens: int) -> int:
    return min(prompt_tokens - MARGIN, handle_tokens) // BLOCK * BLOCK


def _sent_back(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as an agent sends it back: content, and tool calls if any (no reasoning)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                             "arguments": c["function"]["arguments"]}}
                             for c in message["tool_calls"]]
    return out


async def _two_turns(bed: Bed, stream: bool, reply: Reply, *, follow: str = "Thanks. And then?",
                     conv: str = "c1", edit: Any = None, **extra: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Turn 1 with ``reply`` scripted on D, then turn 2 carrying the reply back; returns turn 1's D handle."""
    bed.stub.reply = reply
    m1 = [{"role": "user", "content": QUESTION}]
    answer = await bed.chat(m1, conv, stream, **extra)
    back = _sent_back(answer)
    if edit is not None:
        back = edit(back)
    m2 = [*m1, back]
    if back.get("tool_calls"):
        m2.append({"role": "tool", "tool_call_id": back["tool_calls"][0]["id"], "content": "result: 7"})
    else:
        m2.append({"role": "user", "content": follow})
    bed.stub.reply = Reply("Sure.")
    await bed.chat(m2, conv, stream, **extra)
    return m1, answer


def _turn1_handle_tokens(bed: Bed) -> int:
    return len(next(iter(bed.stub.sequences.values())))


def _turn1_prompt_tokens(bed: Bed, m1: list[dict[str, Any]], **extra: Any) -> int:
    return len(prompt_tokens_of({"messages": m1, **extra}))


# ---------------------------------------------------------------------------------------------- full reuse
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_chat_continuation_is_reused_in_full(bed: Bed, stream: bool) -> None:
    _, answer = await _two_turns(bed, stream, Reply("The answer is 42, as computed.\n\nDetails follow."))
    assert answer["content"] == "The answer is 42, as computed.\n\nDetails follow."
    seen = bed.stub.last_prefill
    handle = _turn1_handle_tokens(bed)
    assert seen.params["remote_num_tokens"] == handle  # D's params untouched
    assert seen.params["remote_block_ids"] == [list(range(-(-handle // BLOCK)))]
    assert seen.read_tokens == handle and seen.wrong_kv_tokens == 0
    ev = await bed.event(2)
    assert ev["lookup"] == "hit" and ev["handle_tokens"] == ev["reuse_limit_tokens"] == handle
    assert ev["trimmed_tokens"] == 0 and "trim_reason" not in ev


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_completion_continuation_is_reused_in_full(bed: Bed, stream: bool) -> None:
    bed.stub.reply = Reply(" Paris, the capital.")
    prompt = "Q: What is the capital of France? " * 8 + "A:"
    text = await bed.completion(prompt, "k1", stream)
    assert text == " Paris, the capital."
    await bed.completion(prompt + text + "\nQ: And of Spain?\nA:", "k1", stream)
    seen = bed.stub.last_prefill
    handle = _turn1_handle_tokens(bed)
    assert seen.params["remote_num_tokens"] == handle and seen.wrong_kv_tokens == 0
    assert (await bed.event(2))["reuse_limit_tokens"] == handle


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_completion_with_another_continuation_is_trimmed_to_the_prompt(bed: Bed, stream: bool) -> None:
    bed.stub.reply = Reply(" Paris.")
    prompt = "Q: What is the capital of France? " * 8 + "A:"
    await bed.completion(prompt, "k2", stream)
    await bed.completion(prompt + " Lyon.\nQ: Sure?\nA:", "k2", stream)
    seen = bed.stub.last_prefill
    limit = _expected_trim(len(prompt), _turn1_handle_tokens(bed))
    assert seen.params["remote_num_tokens"] == limit and seen.params["remote_block_ids"] == [list(range(limit // 16))]
    assert seen.wrong_kv_tokens == 0
    assert (await bed.event(2))["trim_reason"] == "reply_edited"


# ---------------------------------------------------------------------------------------------- untracked parts
UNTRACKED = {
    "reasoning": (Reply("Final.", reasoning="Let me think about prefill."), {}, "reasoning_stripped"),
    "reasoning_content": (Reply("Final.", reasoning="Hmm, decode.", reasoning_field="reasoning_content"), {},
                          "reasoning_stripped"),
    "think_in_content": (Reply("<think>hidden</think>Final"), {}, "reasoning_stripped"),
    "tool_calls": (Reply(None, tool_calls=[{"id": "call-1", "type": "function",
                                            "function": {"name": "lookup", "arguments": '{"q": "kv", "n": 2}'}}]),
                   {"tools": TOOLS}, "tool_call_rerendered"),
    "function_call": (Reply("Calling.", function_call={"name": "lookup", "arguments": "{}"}), {},
                      "tool_call_rerendered"),
    "refusal": (Reply("", refusal="I can't help with that."), {}, "unverifiable"),
    "include_reasoning_false": (Reply("Final.", reasoning="secret plan"), {"extra_body": {"include_reasoning": False}},
                                "reasoning_hidden"),
    "stop_string": (Reply("Final answer", stop_reason="###", generated_extra="###"), {"stop": ["###"]},
                    "unverifiable"),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("case", sorted(UNTRACKED))
async def test_untracked_parts_never_get_kv_beyond_the_previous_prompt(bed: Bed, stream: bool, case: str) -> None:
    reply, extra, reason = UNTRACKED[case]
    m1, _ = await _two_turns(bed, stream, reply, **extra)
    seen = bed.stub.last_prefill
    prompt1 = _turn1_prompt_tokens(bed, m1, tools=extra.get("tools"))
    limit = _expected_trim(prompt1, _turn1_handle_tokens(bed))
    assert seen.params["remote_num_tokens"] == limit < prompt1  # never beyond the previous prompt's own tokens
    assert seen.params["remote_block_ids"] == [list(range(limit // BLOCK))]
    assert seen.wrong_kv_tokens == 0 and seen.read_tokens == limit
    ev = await bed.event(2)
    assert ev["trim_reason"] == reason and ev["reuse_limit_tokens"] == limit
    assert ev["trimmed_tokens"] == ev["handle_tokens"] - limit > 0
    assert bed.registry.get_sample_value("kvdiag_reuse_trimmed_turns_total", {"model": MODEL, "reason": reason}) == 1
    assert bed.registry.get_sample_value("kvdiag_reuse_offered_tokens_total", {"model": MODEL}) == limit
    assert (await bed.event(1))["attrs"]["reply_not_reusable"][0] == reason
    log = (bed.tmp / "proxy.log").read_text()
    assert "conv=c1: not caching D blocks because response history cannot be validated" in log


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_rewritten_reply_is_trimmed_to_the_previous_prompt(bed: Bed, stream: bool) -> None:
    m1, _ = await _two_turns(bed, stream, Reply("Original words."),
                             edit=lambda m: {**m, "content": "Rewritten words."})
    seen = bed.stub.last_prefill
    limit = _expected_trim(_turn1_prompt_tokens(bed, m1), _turn1_handle_tokens(bed))
    assert seen.params["remote_num_tokens"] == limit and seen.wrong_kv_tokens == 0
    ev = await bed.event(2)
    assert ev["trim_reason"] == "reply_edited"
    # A cut handle is still D's blocks sent to P: the reference proxy's hit lines.
    log = (bed.tmp / "proxy.log").read_text()
    assert "conv=c1: cache HIT (age=" in log
    assert f"[{ev['request_id']}] conv=c1: sending D's cached blocks to P" in log
    assert "not caching" not in log and "request history changed" not in log


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_template_options_trim_even_a_verbatim_reply(bed: Bed, stream: bool) -> None:
    # enable_thinking false puts <think></think> into the generation prompt; the history never has it.
    kwargs = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    m1, _ = await _two_turns(bed, stream, Reply("Plain."), **kwargs)
    seen = bed.stub.last_prefill
    prompt1 = _turn1_prompt_tokens(bed, m1, chat_template_kwargs={"enable_thinking": False})
    assert seen.params["remote_num_tokens"] == _expected_trim(prompt1, _turn1_handle_tokens(bed))
    assert seen.wrong_kv_tokens == 0 and (await bed.event(2))["trim_reason"] == "unverifiable"


# ---------------------------------------------------------------------------------------------- history
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_regenerate_is_trimmed_not_misaligned(bed: Bed, stream: bool) -> None:
    bed.stub.reply = Reply("First try.")
    m1 = [{"role": "user", "content": QUESTION}]
    await bed.chat(m1, "r1", stream)
    await bed.chat(m1, "r1", stream)  # the same prompt again: D's handle is longer than it
    seen = bed.stub.last_prefill
    limit = _expected_trim(_turn1_prompt_tokens(bed, m1), _turn1_handle_tokens(bed))
    assert seen.params["remote_num_tokens"] == limit and seen.wrong_kv_tokens == 0
    assert (await bed.event(2))["trim_reason"] == "reply_absent"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_edited_history_falls_back_to_the_turn_before_the_edit(bed: Bed, stream: bool) -> None:
    bed.stub.reply = Reply("One.")
    m1 = [{"role": "user", "content": QUESTION}]
    a1 = await bed.chat(m1, "h1", stream)
    m2 = [*m1, _sent_back(a1), {"role": "user", "content": "Second question, quite long as well. " * 3}]
    bed.stub.reply = Reply("Two.")
    a2 = await bed.chat(m2, "h1", stream)
    # Turn 3 edits turn 2's question: turn 1's prompt and its reply (sent back verbatim on turn 2, so
    # a boundary at the end of D's turn-1 sequence) are still reproduced.
    m3 = [*m1, _sent_back(a1), {"role": "user", "content": "Edited second question."}, _sent_back(a2),
          {"role": "user", "content": "third"}]
    await bed.chat(m3, "h1", stream)
    seen = bed.stub.last_prefill
    limit = _turn1_handle_tokens(bed) // BLOCK * BLOCK
    assert limit > _expected_trim(_turn1_prompt_tokens(bed, m1), limit)
    assert seen.params["remote_num_tokens"] == limit and seen.wrong_kv_tokens == 0
    assert (await bed.event(3))["trim_reason"] == "history_edited"
    # Turn 4 edits the first message: nothing is reproduced, no handle, and the reference proxy's line.
    await bed.chat([{"role": "user", "content": "Different start."}, *m3[1:]], "h1", stream)
    assert bed.stub.last_prefill.params["remote_engine_id"] is None
    ev = await bed.event(4)
    assert ev["outcome"] == "prefix_mismatch" and ev["trim_reason"] == "history_edited"
    assert ev["reuse_limit_tokens"] == 0 and ev["trimmed_tokens"] == ev["handle_tokens"]
    assert "conv=h1: cache MISS (request history changed)" in (bed.tmp / "proxy.log").read_text()


async def test_reasoning_sent_back_in_history_stops_reuse_before_it(bed: Bed) -> None:
    # The client sends the reasoning back. Qwen3's template renders it while no later user query
    # exists (a tool loop) and drops it once one arrives, so a boundary past that message is trusted
    # within the loop and not after the next user query.
    call = {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": '{"q":"kv"}'}}
    bed.stub.reply = Reply("Looking.", reasoning="need data", tool_calls=[call])
    m1 = [{"role": "user", "content": QUESTION}]
    a1 = await bed.chat(m1, "hr", True, tools=TOOLS)
    m2 = [*m1, {**_sent_back(a1), "reasoning_content": a1["reasoning"]},
          {"role": "tool", "tool_call_id": "call-1", "content": "Result. " * 20}]
    bed.stub.reply = Reply("Done.")
    a2 = await bed.chat(m2, "hr", True, tools=TOOLS)
    await bed.chat([*m2, _sent_back(a2), {"role": "user", "content": "third"}], "hr", True, tools=TOOLS)
    seen = bed.stub.last_prefill
    limit = _expected_trim(_turn1_prompt_tokens(bed, m1, tools=TOOLS), len(list(bed.stub.sequences.values())[1]))
    assert seen.params["remote_num_tokens"] == limit and seen.wrong_kv_tokens == 0
    assert (await bed.event(3))["trim_reason"] == "history_reasoning"


async def test_reasoning_sent_back_before_the_last_query_renders_alike(bed: Bed) -> None:
    # Reasoning sent back for a message that was already before the last query in D's prompt:
    # both prompts render it without the trace, so the verbatim reply that follows is reused in full.
    bed.stub.reply = Reply("One.", reasoning="because")
    m1 = [{"role": "user", "content": QUESTION}]
    a1 = await bed.chat(m1, "hq", True)
    m2 = [*m1, {"role": "assistant", "content": a1["content"], "reasoning_content": a1["reasoning"]},
          {"role": "user", "content": "Second question. " * 5}]
    bed.stub.reply = Reply("Two.")
    a2 = await bed.chat(m2, "hq", True)
    await bed.chat([*m2, _sent_back(a2), {"role": "user", "content": "third"}], "hq", True)
    seen = bed.stub.last_prefill
    assert seen.params["remote_num_tokens"] == len(list(bed.stub.sequences.values())[1])
    assert seen.wrong_kv_tokens == 0 and "trim_reason" not in await bed.event(3)


async def test_changed_tools_change_the_prompt_from_its_start(bed: Bed) -> None:
    bed.stub.reply = Reply("One.")
    m1 = [{"role": "user", "content": QUESTION}]
    a1 = await bed.chat(m1, "t1", True, tools=TOOLS)
    other = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    await bed.chat([*m1, _sent_back(a1), {"role": "user", "content": "more"}], "t1", True, tools=other)
    assert bed.stub.last_prefill.params["remote_engine_id"] is None
    assert (await bed.event(2))["outcome"] == "prefix_mismatch"


async def test_unsupported_request_shape_is_not_kept(bed: Bed) -> None:
    bed.stub.reply = Reply("One.")
    m1 = [{"role": "user", "content": QUESTION}]
    a1 = await bed.chat(m1, "u1", True, extra_body={"truncate_prompt_tokens": 100})
    await bed.chat([*m1, _sent_back(a1), {"role": "user", "content": "more"}], "u1", True)
    assert bed.stub.last_prefill.params["remote_engine_id"] is None
    ev1, ev2 = await bed.event(1), await bed.event(2)
    assert ev1["attrs"]["stored"] is False and "truncate_prompt_tokens" in ev1["attrs"]["handle_not_kept"]
    assert ev2["outcome"] == "prefix_mismatch" and ev2["trim_reason"] == "unverifiable"
    assert "conv=u1: not caching D blocks for unsupported request shape" in (bed.tmp / "proxy.log").read_text()


# ---------------------------------------------------------------------------------------------- block size
async def test_without_a_known_block_size_nothing_is_cut(tmp_path: Path) -> None:
    async with bed_for(tmp_path) as bed:
        bed.stub.reply = Reply("Short.")
        m1 = [{"role": "user", "content": "hi"}]  # one short handle: many block sizes fit it
        await bed.chat(m1, "b1", True)
        await bed.chat(m1, "b1", True)  # a regenerate needs a cut handle
        assert bed.stub.last_prefill.params["remote_engine_id"] is None
        ev = await bed.event(2)
        assert ev["trim_reason"] == "unverifiable" and "block size" in ev["attrs"]["reuse_detail"]
        log = (bed.tmp / "proxy.log").read_text()
        assert f"[{ev['request_id']}] conv=b1: cache MISS" in log and "request history changed" not in log


async def test_block_size_flag_and_an_inconsistent_handle(tmp_path: Path) -> None:
    async with bed_for(tmp_path, block_size=32) as bed:  # the stub's D uses 16: its block lists do not fit 32
        bed.stub.reply = Reply("Answer.")
        m1 = [{"role": "user", "content": QUESTION}]
        await bed.chat(m1, "b2", True)
        await bed.chat(m1, "b2", True)
        assert bed.stub.last_prefill.params["remote_engine_id"] is None
        assert "cannot be cut" in (await bed.event(2))["attrs"]["reuse_detail"]


# ---------------------------------------------------------------------------------------------- the store
async def test_coverage_survives_a_router_restart_on_redis(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        async with bed_for(tmp_path / "a", state=url) as bed:
            bed.stub.reply = Reply("Final.", reasoning="thinking")
            m1 = [{"role": "user", "content": QUESTION}]
            a1 = await bed.chat(m1, "rd", True)
            stub = bed.stub
            sequences = dict(stub.sequences)
        async with bed_for(tmp_path / "b", state=url) as bed2:
            bed2.stub.sequences.update(sequences)
            await bed2.chat([*m1, _sent_back(a1), {"role": "user", "content": "next"}], "rd", True)
            seen = bed2.stub.last_prefill
            limit = _expected_trim(_turn1_prompt_tokens(bed2, m1), len(next(iter(sequences.values()))))
            assert seen.params["remote_num_tokens"] == limit and seen.wrong_kv_tokens == 0


# ---------------------------------------------------------------------------------------------- negative control
def _always_full(coverage: Any, view: Any, *, handle_tokens: int, block_size: Any, margin: int = 8) -> Any:
    return reuse_rule.Decision(reuse_rule.Reuse.FULL, handle_tokens)


@pytest.mark.parametrize("case", ["reasoning", "tool_calls", "think_in_content", "include_reasoning_false"])
async def test_negative_control_a_full_handle_rule_loads_wrong_kv(tmp_path: Path, case: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "decide", _always_full)  # the router's rule replaced by "always the full handle"
    async with bed_for(tmp_path) as bed:
        reply, extra, _ = UNTRACKED[case]
        m1, _ = await _two_turns(bed, True, reply, **extra)
        seen = bed.stub.last_prefill
        prompt1 = _turn1_prompt_tokens(bed, m1, tools=extra.get("tools"))
        assert seen.params["remote_num_tokens"] > prompt1  # what the safe tests forbid
        assert seen.wrong_kv_tokens > 0  # and the oracle sees P loading KV computed for other tokens


async def test_negative_control_regenerate_with_the_full_handle_reads_d_s_last_blocks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse, "decide", _always_full)
    async with bed_for(tmp_path) as bed:
        bed.stub.reply = Reply("A long first answer with many words in it. " * 3)
        m1 = [{"role": "user", "content": QUESTION}]
        await bed.chat(m1, "n1", True)
        await bed.chat(m1, "n1", True)
        assert bed.stub.last_prefill.wrong_kv_tokens > 0  # end-trim: P's first blocks got D's later ones


async def test_reasoning_test_catches_a_rule_that_trusts_every_rendering(bed: Bed,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: trusting the boundary past a message whose reasoning the template now drops
    # lets P load wrong KV, which the test above would see.
    from kvdiag.router import reuse_rule

    monkeypatch.setattr(reuse_rule, "trusted_length", lambda coverage, view: view.length)
    with pytest.raises(AssertionError):
        await test_reasoning_sent_back_in_history_stops_reuse_before_it(bed)
    assert bed.stub.last_prefill.wrong_kv_tokens > 0
