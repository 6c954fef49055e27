"""The emulated model's agent output over real HTTP: reasoning and tool-call deltas, response shapes, token ids."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from kvdiag.sim.config import EngineConfig
from kvdiag.sim.pd_driver import read_sse
from kvdiag.sim.server import EngineHandle, start_engine
from kvdiag.sim.tokenizer import THINK_START, detokenize, render_chat, tokenize

Factory = Callable[..., Awaitable[EngineHandle]]
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "grep", "parameters": {
             "type": "object", "properties": {"pattern": {"type": "string"}}}}}]
AGENT = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
Q = [{"role": "user", "content": "find the bug"}]


@pytest.fixture
async def engines() -> AsyncIterator[Factory]:
    started: list[EngineHandle] = []

    async def make(**kw: Any) -> EngineHandle:
        handle = await start_engine(EngineConfig(role="decode", time_scale=0.0, **kw))
        started.append(handle)
        return handle

    yield make
    for handle in started:
        await handle.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                path: str = "/v1/chat/completions") -> tuple[int, Any]:
    async with session.post(url + path, json=body) as resp:
        if body.get("stream"):
            return resp.status, await read_sse(resp)
        return resp.status, await resp.json()


def _deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks if c["choices"]]


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(d.get(key) or "" for d in _deltas(chunks))


async def test_reasoning_parser_streams_the_trace_as_reasoning(engines: Factory,
                                                              session: aiohttp.ClientSession) -> None:
    d = await engines(reasoning_parser="qwen3")
    body = {"messages": Q, "max_tokens": 40, "kvdiag_sim": {"reasoning_tokens": 6}}
    status, full = await _post(session, d.url, body)
    assert status == 200
    msg, choice = full["choices"][0]["message"], full["choices"][0]
    assert msg["reasoning"].startswith("\n") and msg["reasoning"].endswith("\n") and len(msg["reasoning"].split()) == 6
    assert msg["content"].startswith("\n\n") and "<think>" not in msg["content"]
    assert choice["finish_reason"] == "stop" and full["usage"]["completion_tokens"] == 40
    assert full["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    assert "tool_calls" not in msg and "reasoning_content" not in msg  # vLLM 0.33's names
    _, chunks = await _post(session, d.url, dict(body, stream=True))
    assert _joined(chunks, "reasoning") == msg["reasoning"] and _joined(chunks, "content") == msg["content"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["delta"] == {}
    assert full["choices"][0]["token_ids"] is None and full["prompt_token_ids"] is None  # not asked for


async def test_without_a_parser_the_trace_is_content_and_the_old_field_name_is_a_switch(
        engines: Factory, session: aiohttp.ClientSession) -> None:
    plain = await engines(reasoning_tokens=4)
    _, full = await _post(session, plain.url, {"messages": Q, "max_tokens": 30})
    content = full["choices"][0]["message"]["content"]
    assert content.startswith("<think>\n") and "\n</think>\n\n" in content
    assert full["choices"][0]["message"]["reasoning"] is None
    old = await engines(reasoning_parser="qwen3", reasoning_tokens=4, reasoning_field="reasoning_content")
    _, chunks = await _post(session, old.url, {"messages": Q, "max_tokens": 30, "stream": True})
    assert _joined(chunks, "reasoning_content").strip() and not _joined(chunks, "reasoning")


async def test_include_reasoning_false_hides_the_trace_that_was_still_generated(
        engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines(reasoning_parser="qwen3", reasoning_tokens=5)
    body = {"messages": Q, "max_tokens": 30, "include_reasoning": False, "return_token_ids": True}
    _, full = await _post(session, d.url, body)
    assert full["choices"][0]["message"]["reasoning"] is None
    assert full["choices"][0]["token_ids"] is None  # vLLM hides the ids with the trace
    assert full["usage"]["completion_tokens"] == 30  # the trace is generated (and in D's KV) all the same
    _, chunks = await _post(session, d.url, dict(body, stream=True))
    deltas = _deltas(chunks)[1:]
    assert all("reasoning" in x and x["reasoning"] is None for x in deltas if x)
    assert _joined(chunks, "content") == full["choices"][0]["message"]["content"]
    assert all(c["choices"][0].get("token_ids") is None for c in chunks if c["choices"])


async def test_any_server_parser_hides_token_ids_when_reasoning_is_excluded(
        engines: Factory, session: aiohttp.ClientSession) -> None:
    body = {"messages": Q, "max_tokens": 4, "include_reasoning": False, "return_token_ids": True}
    tools_only = await engines(tool_call_parser="hermes")
    _, full = await _post(session, tools_only.url, body)
    assert full["choices"][0]["token_ids"] is None and full["prompt_token_ids"] is not None
    _, chunks = await _post(session, tools_only.url, dict(body, stream=True))
    assert all(c["choices"][0].get("token_ids") is None for c in chunks) and chunks[0]["prompt_token_ids"]
    no_parser = await engines()
    _, full = await _post(session, no_parser.url, body)
    assert len(full["choices"][0]["token_ids"]) == 4  # include_reasoning means nothing without a parser


async def test_enable_thinking_false_writes_no_trace(engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines(reasoning_parser="qwen3", reasoning_tokens=5)
    body = {"messages": Q, "max_tokens": 12, "chat_template_kwargs": {"enable_thinking": False},
            "return_token_ids": True}
    _, full = await _post(session, d.url, body)
    assert THINK_START not in full["choices"][0]["token_ids"] and full["choices"][0]["message"]["reasoning"] is None
    prompt = full["prompt_token_ids"]
    assert detokenize(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


async def test_tool_calls_stream_like_the_hermes_parser(engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines(**AGENT)
    body = {"messages": Q, "tools": TOOLS, "max_tokens": 200,
            "kvdiag_sim": {"reasoning_tokens": 3, "content_tokens": 2, "tool_calls": 2, "tool_arg_tokens": 3}}
    _, full = await _post(session, d.url, body)
    choice = full["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["read_file", "grep"]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    args = [json.loads(c["function"]["arguments"]) for c in calls]
    assert list(args[0]) == ["path"] and list(args[1]) == ["pattern"]
    assert calls[0]["function"]["arguments"] == json.dumps(args[0])  # the parser's json.dumps
    assert choice["message"]["content"].strip() and choice["message"]["content"].endswith("\n")
    _, chunks = await _post(session, d.url, dict(body, stream=True))
    tool_deltas = [tc for x in _deltas(chunks) for tc in x.get("tool_calls") or []]
    heads = [tc for tc in tool_deltas if "id" in tc]
    assert [(h["index"], h["type"], h["function"]) for h in heads] == [
        (0, "function", {"name": "read_file"}), (1, "function", {"name": "grep"})]
    streamed = ["".join(tc["function"].get("arguments", "") for tc in tool_deltas if tc["index"] == i) for i in (0, 1)]
    # streamed arguments are the model's own compact text, not the parser's json.dumps
    assert [json.loads(s) for s in streamed] == args and streamed[0] != calls[0]["function"]["arguments"]
    assert streamed[0] == json.dumps(args[0], separators=(",", ":"))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(x.get("content") is None for x in _deltas(chunks) if x.get("tool_calls"))


async def test_parallel_tool_calls_false_keeps_call_zero_only(engines: Factory,
                                                              session: aiohttp.ClientSession) -> None:
    d = await engines(**AGENT)
    body = {"messages": Q, "tools": TOOLS, "max_tokens": 200, "parallel_tool_calls": False,
            "kvdiag_sim": {"tool_calls": 2}}
    _, full = await _post(session, d.url, body)
    assert len(full["choices"][0]["message"]["tool_calls"]) == 1
    assert full["usage"]["completion_tokens"] > 40  # the model still wrote both calls
    _, chunks = await _post(session, d.url, dict(body, stream=True))
    indexes = {tc["index"] for x in _deltas(chunks) for tc in x.get("tool_calls") or []}
    assert indexes == {0} and {"content": None} in _deltas(chunks)


async def test_tool_choice_rules_follow_vllm(engines: Factory, session: aiohttp.ClientSession) -> None:
    bare = await engines()
    status, err = await _post(session, bare.url, {"messages": Q, "tools": TOOLS})
    assert status == 400 and "--enable-auto-tool-choice and --tool-call-parser" in err["error"]["message"]
    status, _ = await _post(session, bare.url, {"messages": Q, "tools": TOOLS, "tool_choice": "none",
                                                "max_tokens": 4})
    assert status == 200
    d = await engines(**AGENT)
    status, err = await _post(session, d.url, {"messages": Q, "tool_choice": "auto"})
    assert status == 400 and "`tools` must be set" in err["error"]["message"]
    _, named = await _post(session, d.url, {"messages": Q, "tools": TOOLS, "max_tokens": 100,
                                            "tool_choice": {"type": "function", "function": {"name": "grep"}}})
    assert named["choices"][0]["finish_reason"] == "stop"  # OpenAI's finish for a forced function
    assert [c["function"]["name"] for c in named["choices"][0]["message"]["tool_calls"]] == ["grep"]
    _, none = await _post(session, d.url, {"messages": Q, "tools": TOOLS, "tool_choice": "none", "max_tokens": 20,
                                           "kvdiag_sim": {"tool_calls": 2}})
    assert "tool_calls" not in none["choices"][0]["message"]
    status, err = await _post(session, d.url, {"messages": Q, "kvdiag_sim": {"tool_calls": -1}})
    assert status == 400 and "kvdiag_sim.tool_calls" in err["error"]["message"]
    status, err = await _post(session, d.url, {"messages": Q, "kvdiag_sim": {"thoughts": 1}})
    assert status == 400 and "known: reasoning_tokens" in err["error"]["message"]


async def test_openai_sdk_reads_reasoning_and_tool_calls(engines: Factory) -> None:
    d = await engines(**AGENT)
    client = openai.AsyncOpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0)
    try:
        extra = {"kvdiag_sim": {"reasoning_tokens": 4, "tool_calls": 1}}
        resp = await client.chat.completions.create(model="Qwen/Qwen3-32B", messages=Q,  # type: ignore[arg-type]
                                                    tools=TOOLS, max_tokens=120, extra_body=extra)  # type: ignore[arg-type]
        call = resp.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert call.function.name == "read_file" and resp.choices[0].finish_reason == "tool_calls"  # type: ignore[union-attr]
        stream = await client.chat.completions.create(model="Qwen/Qwen3-32B", messages=Q,  # type: ignore[arg-type]
                                                      tools=TOOLS, max_tokens=120, extra_body=extra, stream=True)  # type: ignore[arg-type]
        names, args = [], ""
        async for chunk in stream:
            for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                args += tc.function.arguments or "" if tc.function else ""
        assert names == ["read_file"] and json.loads(args) == json.loads(call.function.arguments)  # type: ignore[union-attr]
    finally:
        await client.close()


# --- return_token_ids and /tokenize -------------------------------------------------------------------

async def test_return_token_ids_chat_and_completions(engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines()
    prompt_ids = render_chat(Q)
    _, full = await _post(session, d.url, {"messages": Q, "max_tokens": 5, "return_token_ids": True})
    assert full["prompt_token_ids"] == prompt_ids and len(full["choices"][0]["token_ids"]) == 5
    assert detokenize(full["choices"][0]["token_ids"]) == full["choices"][0]["message"]["content"]
    _, chunks = await _post(session, d.url, {"messages": Q, "max_tokens": 5, "return_token_ids": True,
                                             "stream": True})
    assert chunks[0]["prompt_token_ids"] == prompt_ids and "token_ids" not in chunks[0]["choices"][0]
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    _, plain = await _post(session, d.url, {"messages": Q, "max_tokens": 5, "stream": True})
    assert plain[0]["prompt_token_ids"] is None and all(c["choices"][0]["token_ids"] is None for c in plain[1:])
    _, comp = await _post(session, d.url, {"prompt": "one two", "max_tokens": 3, "return_token_ids": True},
                          "/v1/completions")
    assert comp["choices"][0]["prompt_token_ids"] == tokenize("one two")
    assert "prompt_token_ids" not in comp and len(comp["choices"][0]["token_ids"]) == 3
    _, cchunks = await _post(session, d.url, {"prompt": "one two", "max_tokens": 3, "return_token_ids": True,
                                              "stream": True}, "/v1/completions")
    assert cchunks[0]["choices"][0]["prompt_token_ids"] == comp["choices"][0]["prompt_token_ids"]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in cchunks[1:])


async def test_stream_chunks_have_vllm_033_keys(engines: Factory, session: aiohttp.ClientSession) -> None:
    d = await engines()
    _, chunks = await _post(session, d.url, {"messages": Q, "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert list(chunks[0]) == ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
    assert list(chunks[1]) == ["id", "object", "created", "model", "choices", "kv_transfer_params"]
    assert list(chunks[1]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
    assert list(chunks[3]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason",
                                             "token_ids", "weight_versions"]
    assert chunks[3]["choices"][0]["finish_reason"] == "length" and chunks[3]["choices"][0]["delta"]["content"]
    assert chunks[4]["choices"] == [] and set(chunks[4]["usage"]) == {
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details"}
    _, full = await _post(session, d.url, {"messages": Q, "max_tokens": 3})
    assert list(full) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                          "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                          "ec_transfer_params", "metrics"]
    assert list(full["choices"][0]["message"]) == ["role", "content", "refusal", "annotations", "audio",
                                                   "function_call", "reasoning"]


async def test_tokenize_returns_the_ids_the_engine_prefills(engines: Factory,
                                                            session: aiohttp.ClientSession) -> None:
    d = await engines(**AGENT, max_model_len=40_000)
    history = [*Q, {"role": "assistant", "content": "", "reasoning": "r",
                    "tool_calls": [{"type": "function", "function": {"name": "grep", "arguments": '{"pattern":"x"}'}}]},
               {"role": "tool", "content": "no match"}]
    kwargs = {"enable_thinking": False}
    _, tok = await _post(session, d.url, {"messages": history, "tools": TOOLS, "chat_template_kwargs": kwargs,
                                          "return_token_strs": True}, "/tokenize")
    _, full = await _post(session, d.url, {"messages": history, "tools": TOOLS, "chat_template_kwargs": kwargs,
                                           "max_tokens": 2, "return_token_ids": True})
    assert tok["tokens"] == full["prompt_token_ids"] and tok["count"] == full["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == 40_000 and "".join(tok["token_strs"]) == detokenize(tok["tokens"])
    _, bare = await _post(session, d.url, {"messages": history, "add_generation_prompt": False}, "/tokenize")
    assert bare["token_strs"] is None and bare["count"] < tok["count"]
    _, comp = await _post(session, d.url, {"prompt": "plain text"}, "/tokenize")
    _, detok = await _post(session, d.url, {"tokens": comp["tokens"]}, "/detokenize")
    assert detok == {"prompt": "plain text"}
    status, err = await _post(session, d.url, {"messages": Q, "add_generation_prompt": True,
                                               "continue_final_message": True}, "/tokenize")
    assert status == 400 and "Cannot set both" in err["error"]["message"]
    status, _ = await _post(session, d.url, {"messages": [{"role": "user", "content": "x " * 50_000}]})
    assert status == 400
