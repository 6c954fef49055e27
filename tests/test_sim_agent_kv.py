"""The oracle: KV blocks carry the token ids they were computed for, so P can count KV it loaded for other ids.

Each agent case runs two real turns through P and D (sockets, side channel, vLLM's positional
pull with its end-trim). A handle injected in full where the next prompt does not reproduce D's
sequence loads wrong KV (the negative control, exact mode off, as on a stock P); a correctly
trimmed handle, or P's exact mode, loads none.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvdiag.schema.events import PrefillReport, read_events
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.pd_driver import TurnResult, run_turn
from kvdiag.sim.server import EngineHandle, start_engine
from kvdiag.sim.tokenizer import generate_text

BS = 16
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]
AGENT = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
THINK = {"kvdiag_sim": {"reasoning_tokens": 24}}
Pair = Callable[..., Awaitable[tuple[EngineHandle, EngineHandle]]]


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    started: list[EngineHandle] = []

    async def make(exact: bool = True, mode: str = "instrumented", prefix_caching: bool = False,
                   **kw: Any) -> tuple[EngineHandle, EngineHandle]:
        events = {"events_file": str(tmp_path / f"p{len(started)}.jsonl")} if mode == "instrumented" else {}
        p = await start_engine(EngineConfig(role="prefill", time_scale=0.0, mode=mode, prefix_caching=prefix_caching,
                                            pull_matching_prefix=exact, **events, **kw))
        d = await start_engine(EngineConfig(role="decode", time_scale=0.0, mode="instrumented", **kw))
        started.extend((p, d))
        return p, d

    yield make
    for handle in started:
        await handle.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


Q1 = [{"role": "user", "content": generate_text(7, 120)}]


def _report(turn: TurnResult) -> PrefillReport:
    assert turn.report is not None, turn.p_body
    return PrefillReport.from_dict(turn.report)


def _trimmed(handle: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The handle cut to ``tokens`` (a multiple of the block size): the count and every block list."""
    return {**handle, "remote_num_tokens": tokens, "remote_block_ids": [g[:tokens // BS] for g in
                                                                         handle["remote_block_ids"]]}


async def _metric(session: aiohttp.ClientSession, url: str, source: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(r'^kvdiag_sim_wrong_kv_tokens_total\{[^}]*source="' + source + r'"[^}]*\} (\S+)$', text, re.M)
    assert match, "the oracle metric is exposed"
    return float(match.group(1))


async def _stripped_reasoning(session: aiohttp.ClientSession, p: EngineHandle, d: EngineHandle,
                              handle_of: Callable[[TurnResult], dict[str, Any]] | None = None) -> tuple[TurnResult,
                                                                                                      TurnResult]:
    """Turn 1 thinks; turn 2 sends back only the content (what every client can): the template drops the trace."""
    t1 = await run_turn(session, p.url, d.url, Q1, None, "c-t1", max_tokens=64, extra=THINK)
    assert t1.d_params is not None and t1.reply and "<think>" not in t1.reply
    msgs = [*Q1, {"role": "assistant", "content": t1.reply}, {"role": "user", "content": generate_text(2, 30)}]
    handle = handle_of(t1) if handle_of else t1.d_params
    return t1, await run_turn(session, p.url, d.url, msgs, handle, "c-t2", max_tokens=16, extra=THINK)


@pytest.mark.parametrize("exact", [True, False])
async def test_a_verbatim_continuation_loads_no_wrong_kv(pair: Pair, session: aiohttp.ClientSession,
                                                         exact: bool) -> None:
    p, d = await pair(exact=exact)
    t1 = await run_turn(session, p.url, d.url, Q1, None, "c-t1", max_tokens=64)
    msgs = [*Q1, {"role": "assistant", "content": t1.reply}, {"role": "user", "content": "and then?"}]
    t2 = await run_turn(session, p.url, d.url, msgs, t1.d_params, "c-t2")
    report = _report(t2)
    assert t1.d_params is not None and report.outcome == "remote_hit"
    assert report.remote_read_tokens == t1.d_params["remote_num_tokens"] and report.wrong_kv_tokens == 0
    assert report.mismatch_tokens == 0 and p.engine.wrong_kv_tokens == 0


async def test_full_handle_on_stripped_reasoning_loads_wrong_kv_without_exact_mode(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=False, reasoning_parser="qwen3")
    _, t2 = await _stripped_reasoning(session, p, d)
    report = _report(t2)
    assert report.remote_read_tokens > 0 and report.wrong_kv_tokens is not None and report.wrong_kv_tokens > 0
    assert report.mismatch_tokens and report.outcome == "prefix_mismatch"  # the digest saw it; the read went on
    assert p.engine.wrong_kv_tokens == report.wrong_kv_tokens
    assert await _metric(session, p.url, "remote_read") == report.wrong_kv_tokens
    assert p.engine.sink is not None and p.engine.sink.flush()
    event = [e for e in read_events(p.engine.sink.path) if e.event == "prefill_request"][-1]
    assert event.wrong_kv_tokens == report.wrong_kv_tokens and event.mismatch_tokens == report.mismatch_tokens


async def test_exact_mode_reads_only_the_proven_prefix(pair: Pair, session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=True, reasoning_parser="qwen3")
    t1, t2 = await _stripped_reasoning(session, p, d)
    report = _report(t2)
    prompt1 = t1.p_body["usage"]["prompt_tokens"]
    assert report.wrong_kv_tokens == 0 and report.mismatch_tokens and report.mismatch_tokens > 0
    # the trace diverges at the first generated token: every full block of turn 1's prompt is reused
    assert report.remote_read_tokens == prompt1 // BS * BS
    assert report.computed_tokens == report.prompt_tokens - report.remote_read_tokens
    assert t2.d_params is not None  # the turn went on normally


async def test_a_correctly_trimmed_handle_loads_no_wrong_kv_on_a_stock_style_p(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=False, reasoning_parser="qwen3")
    keep: dict[str, int] = {}

    def trim(t1: TurnResult) -> dict[str, Any]:
        assert t1.d_params is not None
        keep["tokens"] = t1.p_body["usage"]["prompt_tokens"] // BS * BS
        return _trimmed(t1.d_params, keep["tokens"])

    _, t2 = await _stripped_reasoning(session, p, d, trim)
    report = _report(t2)
    assert report.outcome == "remote_hit" and report.remote_read_tokens == keep["tokens"]
    assert report.wrong_kv_tokens == 0 and p.engine.wrong_kv_tokens == 0


async def test_a_cut_count_with_the_full_block_list_reads_ds_last_blocks(
        pair: Pair, session: aiohttp.ClientSession) -> None:
    # vLLM pairs P's blocks with the END of the list: trimming remote_num_tokens alone is not enough.
    p, d = await pair(exact=False, reasoning_parser="qwen3")

    def count_only(t1: TurnResult) -> dict[str, Any]:
        assert t1.d_params is not None
        return {**t1.d_params, "remote_num_tokens": t1.p_body["usage"]["prompt_tokens"] // BS * BS}

    _, t2 = await _stripped_reasoning(session, p, d, count_only)
    report = _report(t2)
    assert report.remote_read_tokens > 0 and report.wrong_kv_tokens == report.remote_read_tokens


@pytest.mark.parametrize("exact", [True, False])
async def test_regenerate_with_the_full_handle(pair: Pair, session: aiohttp.ClientSession, exact: bool) -> None:
    p, d = await pair(exact=exact)
    t1 = await run_turn(session, p.url, d.url, Q1, None, "c-t1", max_tokens=64)
    assert t1.d_params is not None
    # the client regenerates turn 1: the same prompt, D's handle now covers prompt + reply (longer)
    t2 = await run_turn(session, p.url, d.url, Q1, t1.d_params, "c-t1-again")
    report = _report(t2)
    if exact:
        assert report.wrong_kv_tokens == 0 and report.remote_read_tokens == report.prompt_tokens // BS * BS
    else:  # the negative control: D's last blocks land in P's positions
        assert report.wrong_kv_tokens == report.remote_read_tokens == report.prompt_tokens - 1


@pytest.mark.parametrize("exact", [True, False])
async def test_a_rerendered_tool_call(pair: Pair, session: aiohttp.ClientSession, exact: bool) -> None:
    p, d = await pair(exact=exact, **AGENT)
    extra = {"tools": TOOLS, "kvdiag_sim": {"reasoning_tokens": 6, "tool_calls": 1, "tool_arg_tokens": 12}}
    t1 = await run_turn(session, p.url, d.url, Q1, None, "c-t1", max_tokens=200, stream=False, extra=extra)
    assert t1.d_body is not None and t1.d_params is not None
    msg = t1.d_body["choices"][0]["message"]
    assert msg["tool_calls"] and msg["reasoning"]
    # inside the tool loop the trace is kept, but the call comes back re-serialized
    msgs = [*Q1, {"role": "assistant", "content": msg["content"], "reasoning": msg["reasoning"],
                  "tool_calls": msg["tool_calls"]}, {"role": "tool", "content": generate_text(5, 40)}]
    t2 = await run_turn(session, p.url, d.url, msgs, t1.d_params, "c-t2", stream=False, extra=extra)
    report = _report(t2)
    prompt1 = t1.p_body["usage"]["prompt_tokens"]
    assert report.remote_read_tokens > prompt1  # the trace itself is reusable
    if exact:
        assert report.wrong_kv_tokens == 0 and report.mismatch_tokens
    else:
        assert report.wrong_kv_tokens and report.wrong_kv_tokens > 0


async def test_stock_p_is_byte_compatible_and_the_oracle_still_counts(pair: Pair,
                                                                       session: aiohttp.ClientSession) -> None:
    p, d = await pair(mode="stock", reasoning_parser="qwen3")
    _, t2 = await _stripped_reasoning(session, p, d)
    assert t2.p_params is not None and "kvdiag" not in t2.p_params  # no report, no exact check in stock mode
    assert p.engine.wrong_kv_tokens > 0 and await _metric(session, p.url, "remote_read") == p.engine.wrong_kv_tokens


async def test_exact_mode_needs_ds_digest(pair: Pair, session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=True, reasoning_parser="qwen3")

    def no_digest(t1: TurnResult) -> dict[str, Any]:
        assert t1.d_params is not None
        return {k: v for k, v in t1.d_params.items() if k != "kvdiag_digest"}

    _, t2 = await _stripped_reasoning(session, p, d, no_digest)
    report = _report(t2)
    assert report.mismatch_tokens is None and report.wrong_kv_tokens and report.wrong_kv_tokens > 0


async def test_the_exact_switch_works_at_runtime(pair: Pair, session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=True, reasoning_parser="qwen3")
    async with session.post(f"{p.url}/kvdiag/admin/faults", json={"pull_matching_prefix": False}) as resp:
        assert (await resp.json())["pull_matching_prefix"] is False
    _, t2 = await _stripped_reasoning(session, p, d)
    assert _report(t2).wrong_kv_tokens


async def test_wrong_kv_in_ps_prefix_cache_is_counted_on_the_next_hit(pair: Pair,
                                                                       session: aiohttp.ClientSession) -> None:
    p, d = await pair(exact=False, prefix_caching=True, reasoning_parser="qwen3")
    t1, t2 = await _stripped_reasoning(session, p, d)
    loaded = _report(t2).wrong_kv_tokens
    assert loaded and loaded > 0
    # the same prompt again, no handle: P's prefix cache serves the blocks it filled with D's wrong KV
    msgs = [*Q1, {"role": "assistant", "content": t1.reply}, {"role": "user", "content": generate_text(2, 30)}]
    t3 = await run_turn(session, p.url, d.url, msgs, None, "c-t3", extra=THINK)
    report = _report(t3)
    assert report.local_hit_tokens > 0 and report.wrong_kv_tokens and report.wrong_kv_tokens > 0
    assert await _metric(session, p.url, "local_hit") == report.wrong_kv_tokens
