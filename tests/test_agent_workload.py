"""kvdiag workload's agent profiles against a real emulated engine (vLLM's reasoning and tool parsers) on loopback.

What the client sends back is what a real agent client sends: assistant messages with the content
and structured tool_calls (ids echoed by the tool messages), no reasoning unless asked, tool
results as ``tool`` messages; plus each profile's own history changes, determinism from the seed,
and the bounds (the coding agent's 20-50 turns past 32k tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.schema.events import read_events
from kvdiag.sim.agent_client import CONTINUE, SUMMARY_REQUEST, AgentOptions, run_agent_workload
from kvdiag.sim.agent_plan import (
    AGENT_PROFILES,
    AgentSpec,
    AgentSpecError,
    Step,
    count_turns,
    make_agent_plans,
)
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import EngineHandle, start_engine
from kvdiag.sim.tokenizer import render_chat
from kvdiag.sim.workload_plan import WorkloadConfig

AGENT = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


@pytest.fixture
async def engine() -> AsyncIterator[EngineHandle]:
    handle = await start_engine(EngineConfig(role="decode", time_scale=0.0, **AGENT))
    yield handle
    await handle.close()


Seen = list[tuple[str, int, dict[str, Any], Any]]


async def _run(url: str, spec: AgentSpec, options: AgentOptions | None = None, *, stream: bool = True,
               log: Path | None = None) -> Seen:
    seen: Seen = []

    async def hook(conv: Any, number: int, body: dict[str, Any], result: Any) -> None:
        seen.append((conv.conversation_id, number, json.loads(json.dumps(body)), result))

    config = WorkloadConfig(url=url, stream=stream, seed=spec.seed, concurrency=8)
    result = await run_agent_workload(config, spec, options=options, on_turn=hook, client_log=log)
    assert result.status_counts() == {"ok": len(seen)}
    return seen


def _bodies(seen: Seen, conv: str) -> list[dict[str, Any]]:
    return [body for c, _, body, _ in sorted(seen, key=lambda s: s[1]) if c == conv]


@pytest.mark.parametrize("stream", [True, False])
async def test_coding_agent_sends_tool_calls_back_structured(engine: EngineHandle, stream: bool) -> None:
    spec = AgentSpec(profile="coding-agent", seed=4, turns=5, scale=0.1)
    seen = await _run(engine.url, spec, stream=stream)
    conv = seen[0][0]
    bodies = _bodies(seen, conv)
    results = [r for c, _, _, r in sorted(seen, key=lambda s: s[1]) if c == conv]
    assert len(bodies) == 5
    for body, prev_result, nxt in zip(bodies, results, bodies[1:], strict=False):
        assert body["tools"] and body["tool_choice"] == "auto" and "kvdiag_sim" in body
        n = len(body["messages"])
        assert nxt["messages"][:n] == body["messages"]  # the history only grows
        reply = nxt["messages"][n]
        assert reply["role"] == "assistant" and "reasoning_content" not in reply and "reasoning" not in reply
        assert prev_result.reasoning  # the model did think: the client just does not send it back
        calls = reply["tool_calls"]
        # the content as received (vLLM's parser passes the "\n\n" after the trace on), None if there was none
        assert calls and reply["content"] == (prev_result.text or None)
        assert [c["id"] for c in calls] == [c["id"] for c in prev_result.tool_calls]
        assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
        arguments = calls[0]["function"]["arguments"]
        # streamed: the model's own argument text (compact); full response: vLLM's json.dumps (spaced)
        assert (": " not in arguments) if stream else (": " in arguments)
        tools = nxt["messages"][n + 1:]
        assert [t["role"] for t in tools] == ["tool"] * len(calls)
        assert [t["tool_call_id"] for t in tools] == [c["id"] for c in calls]
        # the template re-renders the call, so the prompt differs from what D generated after the trace
        assert "<think>" not in json.dumps(nxt["messages"])


async def test_reasoning_variants(engine: EngineHandle) -> None:
    spec = AgentSpec(profile="reasoning-chat", seed=1, turns=3, scale=0.2)
    sent = await _run(engine.url, spec, AgentOptions(send_reasoning=True))
    bodies = _bodies(sent, sent[0][0])
    replies = [m for m in bodies[-1]["messages"] if m["role"] == "assistant"]
    assert len(replies) == 2 and all(m["reasoning_content"] and m["content"] for m in replies)
    first = next(r for c, t, _, r in sent if t == 1)
    assert replies[0]["reasoning_content"] == first.reasoning
    hidden = await _run(engine.url, spec, AgentOptions(hide_reasoning=True))
    assert all(body["include_reasoning"] is False for _, _, body, _ in hidden)
    assert all(r.reasoning == "" and r.text for _, _, _, r in hidden)
    off = await _run(engine.url, spec, AgentOptions(thinking=False))
    assert all(body["chat_template_kwargs"] == {"enable_thinking": False} for _, _, body, _ in off)
    assert all(r.reasoning == "" for _, _, _, r in off)
    # the same seed, the same conversation: replies are the same whatever the client does with the trace
    assert next(r.text for *_, r in sorted(hidden, key=lambda s: s[1])) == first.text


async def test_parallel_tool_calls_come_back_as_consecutive_tool_messages(engine: EngineHandle) -> None:
    seen = await _run(engine.url, AgentSpec(profile="parallel-tools", seed=3, turns=4, scale=0.1))
    bodies = _bodies(seen, seen[0][0])
    multi = 0
    for body, nxt in itertools.pairwise(bodies):
        reply = nxt["messages"][len(body["messages"])]
        calls = reply.get("tool_calls") or []
        tools = nxt["messages"][len(body["messages"]) + 1:]
        assert [t["tool_call_id"] for t in tools if t["role"] == "tool"] == [c["id"] for c in calls]
        multi += len(calls) >= 2
        names = [c["function"]["name"] for c in calls]
        assert names == [("read_file", "run_command", "search_code", "task")[j % 4] for j in range(len(calls))]
    assert multi >= 2


async def test_sub_agents_run_under_their_own_ids_from_a_shared_prefix(engine: EngineHandle, tmp_path: Path) -> None:
    spec = AgentSpec(profile="sub-agents", seed=5, turns=6, scale=0.1)
    plans = make_agent_plans(spec)
    seen = await _run(engine.url, spec, log=tmp_path / "c.jsonl")
    parent = plans[0].conversation_id
    subs = {c for c, *_ in seen if c != parent}
    assert len(seen) == count_turns(plans)
    assert subs and all(s.startswith(parent + "-sub") for s in subs)
    parent_first = _bodies(seen, parent)[0]["messages"]
    for sub in subs:
        first = _bodies(seen, sub)[0]["messages"]
        assert first[:2] == parent_first[:2] and first[2]["role"] == "user"  # system + the task, shared
        assert render_chat(first, tools=_bodies(seen, sub)[0]["tools"])[:100] == \
            render_chat(parent_first, tools=_bodies(seen, parent)[0]["tools"])[:100]
    spawn = next(n for n, _ in plans[0].sub_agents)
    answers = next(body for c, t, body, _ in seen if c == parent and t == spawn)["messages"]
    finals = {next(r for c, t, _, r in sorted(seen, key=lambda s: -s[1]) if c == sub).text for sub in subs}
    assert {m["content"] for m in answers if m["role"] == "tool"} & finals  # the sub-agents' answers come back
    events = list(read_events(tmp_path / "c.jsonl"))
    assert {e.attrs["scenario"] for e in events if e.conversation_id == parent} >= {"task", "sub_agents"}


async def test_compaction_replaces_the_history_by_its_summary(engine: EngineHandle) -> None:
    seen = await _run(engine.url, AgentSpec(profile="compaction", seed=2, turns=12, scale=0.3))
    bodies = _bodies(seen, seen[0][0])
    at = [i for i, b in enumerate(bodies) if b["messages"][-1]["content"] == SUMMARY_REQUEST]
    assert at, "the prompt passed the compaction size"
    i = at[0]
    summary = [r for c, t, _, r in sorted(seen, key=lambda s: s[1])][i].text
    after = bodies[i + 1]["messages"]
    assert [m["role"] for m in after] == ["system", "user"] and after[0] == bodies[i]["messages"][0]
    assert after[1]["content"] == CONTINUE + summary
    assert len(render_chat(after)) < len(render_chat(bodies[i]["messages"])) // 2


async def test_edits_and_regenerations(engine: EngineHandle, tmp_path: Path) -> None:
    spec = AgentSpec(profile="edits", seed=2, turns=12)
    seen = await _run(engine.url, spec, log=tmp_path / "c.jsonl")
    steps = {e.turn: e.attrs["scenario"] for e in read_events(tmp_path / "c.jsonl")}
    assert {"regenerate", "edit_last_user", "edit_reply", "edit_history"} <= set(steps.values())
    bodies = _bodies(seen, seen[0][0])
    assert all("tools" not in b for b in bodies)
    for turn, step in steps.items():
        prev, body = bodies[turn - 2]["messages"], bodies[turn - 1]["messages"]
        if step == "regenerate":
            assert body == prev
        elif step == "edit_last_user":
            assert body[:-1] == prev[:-1] and body[-1]["role"] == "user" and body[-1] != prev[-1]
        elif step == "edit_reply":
            assert body[:len(prev)] == prev and body[len(prev)]["role"] == "assistant"
            edited = body[len(prev)]["content"]
            assert edited.split(" ")[:3] == _reply_of(seen, turn - 1).split(" ")[:3] and edited != _reply_of(seen,
                                                                                                             turn - 1)
        elif step == "edit_history":
            changed = [i for i, (a, b) in enumerate(zip(prev, body, strict=False)) if a != b]
            assert len(changed) == 1 and body[changed[0]]["role"] == "user" and changed[0] < len(prev) - 1


def _reply_of(seen: Seen, turn: int) -> str:
    return next(r.text for _, t, _, r in seen if t == turn)


def test_plans_are_seeded_bounded_and_the_coding_agent_is_long() -> None:
    for profile in AGENT_PROFILES:
        spec = AgentSpec(profile=profile, conversations=3, seed=7)
        assert make_agent_plans(spec) == make_agent_plans(spec)
        assert make_agent_plans(spec) != make_agent_plans(AgentSpec(profile=profile, conversations=3, seed=8))
        assert count_turns(make_agent_plans(spec)) < 1000
    coding = make_agent_plans(AgentSpec(profile="coding-agent", conversations=20, seed=1))
    assert all(20 <= len(p.turns) <= 50 for p in coding)
    assert all(p.turns[0].step is Step.TASK and p.turns[-1].reply.tool_calls == 0 for p in coding)
    for bad, needle in (({"profile": "nope"}, "--profile"), ({"profile": "edits", "turns": 2}, "--turns"),
                        ({"profile": "edits", "scale": 9.0}, "--size-scale")):
        with pytest.raises(AgentSpecError, match=needle):
            make_agent_plans(AgentSpec(**bad))


async def test_the_coding_agent_grows_past_32k_tokens(engine: EngineHandle, tmp_path: Path) -> None:
    log = tmp_path / "c.jsonl"
    await run_agent_workload(WorkloadConfig(url=engine.url, seed=1), AgentSpec(profile="coding-agent", seed=1),
                             client_log=log)
    events = list(read_events(log))
    assert 20 <= len(events) <= 50 and all(e.status == "ok" for e in events)
    assert max(e.prompt_tokens or 0 for e in events) > 32_768
    tokens = [e.prompt_tokens for e in sorted(events, key=lambda e: e.turn or 0)]
    assert tokens == sorted(tokens)


def test_cli_agent_profile_options(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli, ["workload", "--profile", "edits", "--regenerate-share", "0.2"])
    assert out.exit_code == 1 and "--regenerate-share" in out.output and "chat-profile" in out.output
    out = CliRunner().invoke(cli, ["workload", "--send-reasoning"])
    assert out.exit_code == 1 and "--profile" in out.output
    out = CliRunner().invoke(cli, ["workload", "--profile", "reasoning-chat", "--send-reasoning", "--hide-reasoning"])
    assert out.exit_code == 1 and "exclude" in out.output
    out = CliRunner().invoke(cli, ["workload", "--profile", "edits", "--turns", "1"])
    assert out.exit_code == 1 and "--turns" in out.output


async def test_cli_runs_an_agent_profile(engine: EngineHandle, tmp_path: Path) -> None:
    log, stats = tmp_path / "c.jsonl", tmp_path / "s.json"
    out = await asyncio.to_thread(CliRunner().invoke, cli, [
        "workload", "-u", engine.url, "--profile", "parallel-tools", "-n", "1", "-t", "3", "--size-scale", "0.1",
        "--hide-reasoning", "-o", str(log), "--stats-json-output", str(stats)])
    assert out.exit_code == 0, out.output
    assert "3 requests" in out.output
    events = list(read_events(log))
    assert [e.attrs["scenario"] for e in events][:2] == ["task", "tool_results"] and len(events) == 3
    assert all(e.attrs["include_reasoning"] is False and e.attrs["profile"] == "parallel-tools" for e in events)
    assert len(json.loads(stats.read_text())) == 3
