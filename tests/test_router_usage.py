"""Reuse the client sees: usage.prompt_tokens_details.cached_tokens and the kvdiag-reuse header.

The real openai SDK talks to a real router in front of vLLM-shaped P and D (router_support.VllmStub)
that count cached tokens as vLLM 0.33 does: P's count (local + tokens read from D) in P's usage when
P shows prompt details, and always in the ``remote_prefill_cached_tokens`` P hands D. D's own usage
describes D (it got the whole prompt from P): the router replaces it with P's count.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from router_support import BLOCK, Reply, VllmStub, fake_backends, prompt_tokens_of

from kvdiag.router.app import RouterHandle, start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.router.usage import HEADER, PrefillReuse, UsageRewriter, prefill_reuse, reuse_header
from kvdiag.schema.events import PrefillReport
from kvdiag.schema.verdicts import TrimReason, Verdict

QUESTION = "What is six times seven? Explain the multiplication step by step for a child."
# RFC 8941 item: a token, then ';' parameters whose values are integers or tokens.
GRAMMAR = re.compile(r"^[a-z][a-z_]*(?:; [a-z]+=(?:\d{1,15}|[a-z][a-z_]*))*$")


class CountingStub(VllmStub):
    """VllmStub whose P and D report cached tokens as vLLM 0.33 does (see the module docstring)."""

    p_details: bool = True  # P runs with --enable-prompt-tokens-details
    d_usage: str = "own"  # D's usage: "own" (its ~100% from the transfer), "none" (no details)

    def _prefill(self, body: dict[str, Any], params: dict[str, Any], prompt: list[int], rid: str,
                 chat: bool) -> dict[str, Any]:
        out = super()._prefill(body, params, prompt, rid, chat)
        cached = self.prefills[-1].read_tokens
        out["kv_transfer_params"]["remote_prefill_cached_tokens"] = cached
        if self.p_details:
            out["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        else:
            out["usage"].pop("prompt_tokens_details", None)
        return out

    async def _decode(self, request: Any, body: dict[str, Any], prompt: list[int], rid: str,
                      chat: bool) -> Any:
        self.d_bodies.append(body)
        return await super()._decode(request, body, prompt, rid, chat)

    def _full(self, rid: str, chat: bool, shown: Reply, gen_ids: Any, prompt_ids: Any, usage: dict[str, Any],
              params: dict[str, Any]) -> dict[str, Any]:
        return super()._full(rid, chat, shown, gen_ids, prompt_ids, self._d_usage(usage), params)

    def _frames(self, rid: str, chat: bool, shown: Reply, generated: list[int], prompt: list[int], ids: bool,
                usage: dict[str, Any], params: dict[str, Any], body: dict[str, Any]) -> list[bytes]:
        frames = super()._frames(rid, chat, shown, generated, prompt, ids, self._d_usage(usage), params, body)
        self.d_streams.append(b"".join(frames))
        return frames

    def _d_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        if self.d_usage == "own":
            return {**usage, "prompt_tokens_details": {"cached_tokens": usage["prompt_tokens"] - 1}}
        return usage

    async def start(self) -> CountingStub:
        self.d_bodies: list[dict[str, Any]] = []
        self.d_streams: list[bytes] = []
        await super().start()
        return self


@dataclass
class Bed:
    stub: CountingStub
    router: RouterHandle
    client: openai.AsyncOpenAI


@contextlib.asynccontextmanager
async def bed_for(tmp: Path) -> AsyncIterator[Bed]:
    stub = await CountingStub().start()
    config = RouterConfig(prefill=(Upstream("127.0.0.1", stub.port),), decode=(Upstream("127.0.0.1", stub.port),),
                          host="127.0.0.1", port=0, events_file=tmp / "events.jsonl", block_size=BLOCK)
    router = await start_router(config)
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    try:
        yield Bed(stub, router, client)
    finally:
        await client.close()
        await router.close()
        await stub.close()


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[Bed]:
    async with bed_for(tmp_path) as b:
        yield b


async def turn(bed: Bed, messages: list[dict[str, Any]], stream: bool, usage: bool = True) -> tuple[
        str, str, Any]:
    """One turn with the SDK: (reply text, kvdiag-reuse header, usage the SDK parsed or None)."""
    kw: dict[str, Any] = {"model": "Qwen/Qwen3-32B", "messages": messages, "extra_body": {"conversation_id": "c1"}}
    if not stream:
        raw = await bed.client.chat.completions.with_raw_response.create(**kw)
        completion = raw.parse()
        return completion.choices[0].message.content or "", raw.headers[HEADER], completion.usage
    if usage:
        kw["stream_options"] = {"include_usage": True}
    raw = await bed.client.chat.completions.with_raw_response.create(stream=True, **kw)
    text, final = "", None
    async for chunk in raw.parse():
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if chunk.usage is not None:
            assert not chunk.choices  # only the final usage chunk carries usage
            final = chunk.usage
    return text, raw.headers[HEADER], final


def usage_frames(stream: bytes) -> bytes:
    """The one final usage chunk of an SSE stream (choices empty), as sent."""
    found = [f + b"\n\n" for f in stream.split(b"\n\n") if b'"choices":[]' in f and b'"usage"' in f]
    assert len(found) == 1, found
    return found[0]


def params_of(header: str) -> dict[str, str]:
    assert GRAMMAR.match(header), header
    verdict, *rest = header.split("; ")
    return {"verdict": verdict, **dict(p.split("=", 1) for p in rest)}


# ---------------------------------------------------------------------------------------------- the SDK's view
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_the_sdk_sees_what_p_did_not_compute(bed: Bed, stream: bool) -> None:
    m1 = [{"role": "user", "content": QUESTION}]
    bed.stub.reply = Reply("Six times seven is forty-two.")
    text, header, usage = await turn(bed, m1, stream)
    prompt1 = len(prompt_tokens_of({"messages": m1}))
    assert params_of(header) == {"verdict": "first_turn", "prompt": str(prompt1), "reused": "0"}
    assert usage.prompt_tokens == prompt1
    # D said it had all but one token cached (the P->D transfer); P computed them all.
    assert usage.prompt_tokens_details.cached_tokens == 0

    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "And seven times eight?"}]
    bed.stub.reply = Reply("Fifty-six.")
    _, header, usage = await turn(bed, m2, stream)
    read = bed.stub.last_prefill.read_tokens
    assert read > 3 * BLOCK and bed.stub.last_prefill.wrong_kv_tokens == 0
    prompt2 = len(prompt_tokens_of({"messages": m2}))
    assert params_of(header) == {"verdict": "remote_hit", "prompt": str(prompt2), "reused": str(read),
                                 "handle": "full"}
    assert usage.prompt_tokens == prompt2 and usage.prompt_tokens_details.cached_tokens == read


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_cut_handle_reports_the_tokens_read_and_why(bed: Bed, stream: bool) -> None:
    m1 = [{"role": "user", "content": QUESTION}]
    bed.stub.reply = Reply("Forty-two.", reasoning="six sevens: 7+7+7+7+7+7 = 42, checking twice to be sure")
    text, _, _ = await turn(bed, m1, stream)
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "Thanks. And then?"}]
    bed.stub.reply = Reply("Sure.")
    _, header, usage = await turn(bed, m2, stream)
    read = bed.stub.last_prefill.read_tokens
    got = params_of(header)
    assert got["verdict"] == "remote_hit" and got["handle"] == "trimmed" and got["trim"] == "reasoning_stripped"
    assert int(got["reused"]) == read == usage.prompt_tokens_details.cached_tokens > 0
    assert read % BLOCK == 0 and bed.stub.last_prefill.wrong_kv_tokens == 0


async def test_p_without_prompt_details_still_gives_its_count_through_its_params(bed: Bed) -> None:
    bed.stub.p_details = False  # vLLM 0.33 hands D remote_prefill_cached_tokens either way
    bed.stub.d_usage = "none"  # and this D shows no details at all
    m1 = [{"role": "user", "content": QUESTION}]
    bed.stub.reply = Reply("Forty-two.")
    text, _, _ = await turn(bed, m1, True)
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    _, header, usage = await turn(bed, m2, True)
    read = bed.stub.last_prefill.read_tokens
    assert params_of(header)["reused"] == str(read) and usage.prompt_tokens_details.cached_tokens == read


async def test_a_stream_without_include_usage_passes_through_byte_for_byte(bed: Bed) -> None:
    m1 = [{"role": "user", "content": QUESTION}]
    bed.stub.reply = Reply("Forty-two.")
    text, header, usage = await turn(bed, m1, True, usage=False)
    assert usage is None and params_of(header)["verdict"] == "first_turn"
    assert "stream_options" not in bed.stub.d_bodies[-1]
    m2 = [*m1, {"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    async with bed.client.chat.completions.with_streaming_response.create(
            model="m", messages=m2, stream=True, extra_body={"conversation_id": "c1"}) as resp:
        received = b"".join([chunk async for chunk in resp.iter_bytes()])
    assert received == bed.stub.d_streams[-1]  # not one byte rewritten


async def test_with_include_usage_only_the_final_usage_chunk_changes(bed: Bed) -> None:
    m1 = [{"role": "user", "content": QUESTION}]
    bed.stub.reply = Reply("Forty-two, as the table says.")
    async with bed.client.chat.completions.with_streaming_response.create(
            model="m", messages=m1, stream=True, stream_options={"include_usage": True},
            extra_body={"conversation_id": "c1"}) as resp:
        received = b"".join([chunk async for chunk in resp.iter_bytes()])
    sent = bed.stub.d_streams[-1]
    sent_usage, received_usage = usage_frames(sent), usage_frames(received)
    assert sent.replace(sent_usage, b"") == received.replace(received_usage, b"")
    assert json.loads(sent_usage[6:])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # D's own count
    assert json.loads(received_usage[6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_an_instrumented_p_report_gives_local_and_remote(tmp_path: Path) -> None:
    async with fake_backends() as (ps, ds):
        ps[0].p_report = {"v": 1, "engine_request_id": "e1", "prompt_tokens": 30, "local_hit_tokens": 16,
                          "remote_offered_tokens": 8, "remote_read_tokens": 8, "computed_tokens": 6,
                          "outcome": "remote_hit"}
        config = RouterConfig(prefill=(Upstream("127.0.0.1", ps[0].port),),
                              decode=(Upstream("127.0.0.1", ds[0].port),), host="127.0.0.1", port=0)
        router = await start_router(config)
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
            header = raw.headers[HEADER]
            assert params_of(header) == {"verdict": "first_turn", "prompt": "30", "reused": "24", "remote": "8",
                                         "local": "16"}
            assert raw.parse().usage.prompt_tokens_details.cached_tokens == 24
        finally:
            await client.close()
            await router.close()


# ---------------------------------------------------------------------------------------------- units
def test_the_header_is_bounded_for_every_verdict_and_reason() -> None:
    reuse = PrefillReuse(10**9, 10**9, 10**9, 10**9)
    longest = 0
    for verdict in Verdict:
        for trim in (None, *TrimReason):
            for limit in (0, 16):
                value = reuse_header(verdict, reuse, 32, limit, trim)
                assert GRAMMAR.match(value), value
                longest = max(longest, len(value))
    assert longest < 160
    assert reuse_header(Verdict.UNKNOWN, None, None, None, None) == "unknown"


def test_p_s_count_comes_from_the_report_then_its_params_then_its_usage() -> None:
    report = PrefillReport("e", 100, 16, 64, 48, 36, "remote_hit")
    usage = {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 7}}
    assert prefill_reuse(report, usage, {"remote_prefill_cached_tokens": 5}) == PrefillReuse(100, 64, 48, 16)
    assert prefill_reuse(None, usage, {"remote_prefill_cached_tokens": 5}) == PrefillReuse(100, 5)
    assert prefill_reuse(None, usage, {}) == PrefillReuse(100, 7)
    assert prefill_reuse(None, {"prompt_tokens": 100}, None) == PrefillReuse(100, None)
    assert prefill_reuse(None, None, {"remote_prefill_cached_tokens": True}) == PrefillReuse(None, None)


def _vllm_stream(usage_details: bool, continuous: bool) -> bytes:
    """A vLLM 0.33 chat stream (compact JSON) ending in the usage chunk; content that mentions "usage"."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    usage: dict[str, Any] = {"prompt_tokens": 90, "total_tokens": 95, "completion_tokens": 5}
    if usage_details:
        usage["prompt_tokens_details"] = {"cached_tokens": 89}
    deltas = [{"role": "assistant", "content": ""}] + [{"content": f'say "usage": [] {i}'} for i in range(5)]
    frames = []
    for delta in deltas:
        frame: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None}]}
        if continuous:
            frame["usage"] = usage
        frames.append(frame)
    frames.append({**head, "choices": [], "usage": usage})
    out = b"".join(b"data: " + json.dumps(f, separators=(",", ":")).encode() + b"\n\n" for f in frames)
    return out + b"data: [DONE]\n\n"


@pytest.mark.parametrize("details", [True, False])
@pytest.mark.parametrize("continuous", [True, False])
def test_rewriter_touches_only_the_final_usage_chunk_at_any_split(details: bool, continuous: bool) -> None:
    stream = _vllm_stream(details, continuous)
    final = usage_frames(stream)
    expected_final = json.loads(final[6:])
    expected_final["usage"]["prompt_tokens_details"] = {"cached_tokens": 48}
    rng = random.Random(7)
    cuts = [sorted(rng.sample(range(1, len(stream)), k)) for k in (1, 2, 5, 40) for _ in range(25)]
    cuts += [[i] for i in range(1, len(stream))]
    for positions in cuts:
        rewriter = UsageRewriter(48)
        pieces = [stream[a:b] for a, b in zip([0, *positions], [*positions, len(stream)], strict=True)]
        out = b"".join(rewriter.feed(p) for p in pieces) + rewriter.flush()
        got_final = usage_frames(out)
        assert out.replace(got_final, b"") == stream.replace(final, b""), positions
        assert json.loads(got_final[6:]) == expected_final
