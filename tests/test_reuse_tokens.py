"""``--verify-tokens``: reuse proven token by token (P's /tokenize of the new prompt against D's sequence)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from router_support import BLOCK, Reply, prompt_tokens_of, tokens
from test_reuse_http import MARGIN, QUESTION, TOOLS, Bed, _sent_back, _two_turns, bed_for

from kvdiag.router.sse import TokenIdStripper, strip_token_ids


def _lcp(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _d_sequence(bed: Bed, n: int = 0) -> list[int]:
    return list(bed.stub.sequences.values())[n]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_rerendered_tool_call_reuses_every_block_up_to_the_first_differing_token(
        tmp_path: Path, stream: bool) -> None:
    async with bed_for(tmp_path, verify_tokens=True) as bed:
        call = {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kv"}'}}
        m1, answer = await _two_turns(bed, stream, Reply(None, tool_calls=[call]), tools=TOOLS)
        seen = bed.stub.last_prefill
        m2 = [*m1, _sent_back(answer), {"role": "tool", "tool_call_id": "call-1", "content": "result: 7"}]
        lcp = _lcp(_d_sequence(bed), prompt_tokens_of({"messages": m2, "tools": TOOLS}))
        text_limit = (len(prompt_tokens_of({"messages": m1, "tools": TOOLS})) - MARGIN) // BLOCK * BLOCK
        assert seen.params["remote_num_tokens"] == lcp // BLOCK * BLOCK >= text_limit
        assert seen.params["remote_block_ids"] == [list(range(lcp // BLOCK))] and seen.wrong_kv_tokens == 0
        ev = await bed.event(2)
        assert ev["trim_reason"] == "tool_call_rerendered" and ev["attrs"]["verified_tokens"] >= text_limit
        assert ev["attrs"]["tokenize_ms"] >= 0 and bed.stub.tokenize_calls == 1


async def test_tokens_find_what_text_cannot_see(tmp_path: Path) -> None:
    # D generated tokens no field shows (here a marker before the end): the text rule would give the
    # full handle; the tokens cut it at the first difference.
    async with bed_for(tmp_path, verify_tokens=True) as bed:
        await _two_turns(bed, True, Reply("Visible text.", generated_extra="<|im_start|>"))
        seen = bed.stub.last_prefill
        assert seen.wrong_kv_tokens == 0 and seen.params["remote_num_tokens"] < len(_d_sequence(bed))
        assert (await bed.event(2))["trim_reason"] == "token_mismatch"
    async with bed_for(tmp_path / "text") as bed:  # the same turn under the text rule: wrong KV
        await _two_turns(bed, True, Reply("Visible text.", generated_extra="<|im_start|>"))
        assert bed.stub.last_prefill.wrong_kv_tokens > 0  # the limit of text equality, which tokens lift


async def test_a_verbatim_reply_is_reused_in_full_by_tokens(tmp_path: Path) -> None:
    async with bed_for(tmp_path, verify_tokens=True) as bed:
        await _two_turns(bed, True, Reply("Plain words."))
        seen = bed.stub.last_prefill
        assert seen.params["remote_num_tokens"] == len(_d_sequence(bed)) and seen.wrong_kv_tokens == 0
        assert "trim_reason" not in await bed.event(2)


async def test_token_ids_the_client_did_not_ask_for_are_removed(tmp_path: Path) -> None:
    async with bed_for(tmp_path, verify_tokens=True) as bed, aiohttp.ClientSession() as s:
        bed.stub.reply = Reply("Some words here.")
        for stream in (True, False):
            body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "stream": stream,
                    "conversation_id": f"ids-{stream}"}
            async with s.post(bed.router.url + "/v1/chat/completions", json=body) as resp:
                raw = await resp.read()
            assert b'"token_ids":[' not in raw and b'"prompt_token_ids":[' not in raw
            assert bed.stub.decodes[-1]["return_token_ids"] is True  # the router asked D
            async with s.post(bed.router.url + "/v1/chat/completions",
                              json={**body, "return_token_ids": True, "conversation_id": f"own-{stream}"}) as resp:
                raw = await resp.read()
            assert b'"token_ids":[' in raw  # the client's own ask is honoured
        assert json.loads(raw)["choices"][0]["token_ids"] == tokens(bed.stub.reply.generated_text())


async def test_a_request_tokenize_cannot_render_alike_uses_the_text_rule(tmp_path: Path) -> None:
    async with bed_for(tmp_path, verify_tokens=True) as bed:
        await _two_turns(bed, True, Reply("Final.", reasoning="r"), extra_body={"reasoning_effort": "low"})
        assert bed.stub.tokenize_calls == 0
        ev = await bed.event(2)
        assert "renders differently" in ev["attrs"]["verify"] and ev["trim_reason"] == "reasoning_stripped"


def test_stripper_rewrites_whole_frames_only() -> None:
    frame = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[1,2]}],"prompt_token_ids":[5]}\n\n'
    stripper = TokenIdStripper()
    out = stripper.feed(frame[:30]) + stripper.feed(frame[30:]) + stripper.flush()
    assert out == strip_token_ids(frame) and b"[1,2]" not in out and b'"token_ids":null' in out
    assert json.loads(out[6:])["prompt_token_ids"] is None
    content = b'data: {"choices":[{"delta":{"content":"\\"token_ids\\":[1]"}}]}\n\n'
    assert strip_token_ids(content) == content  # text that looks like a list stays
