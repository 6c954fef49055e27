"""kvdiag workload against a small OpenAI-compatible fake served over a real socket."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.schema.events import read_events
from kvdiag.sim.tokenizer import detokenize, generate_reply, render_chat
from kvdiag.sim.workload import REQUEST_STATS_FIELDS, run_workload
from kvdiag.sim.workload_plan import (
    ConversationPlan,
    Scenario,
    TurnPlan,
    WorkloadConfig,
    WorkloadConfigError,
    make_plans,
    sample_gap,
)


@dataclass
class FakeServer:
    """Replies with deterministic sim-tokenizer words; records bodies, overlap and disconnects."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    disconnects: int = 0
    chunk_delay: float = 0.005


async def _handler(server: FakeServer, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    server.bodies.append(body)
    if body.get("model") != "Qwen/Qwen3-32B":
        return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}},
                                 status=404)
    server.in_flight += 1
    server.max_in_flight = max(server.max_in_flight, server.in_flight)
    try:
        prompt = render_chat(body["messages"])
        reply = generate_reply(0, prompt, body["max_tokens"])
        rid = request.headers.get("X-Request-Id", "none")
        headers = {"X-Request-Id": rid}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(reply),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body.get("stream"):
            await asyncio.sleep(server.chunk_delay)
            return web.json_response({"id": f"chatcmpl-{rid}", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": detokenize(reply)},
                 "finish_reason": "length"}], "usage": usage, "kv_transfer_params": None}, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for tok in reply:
                await asyncio.sleep(server.chunk_delay)
                chunk = {"choices": [{"index": 0, "delta": {"content": detokenize([tok])}, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage,
                     "kv_transfer_params": {"do_remote_decode": True}}
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            server.disconnects += 1
            raise
        return resp
    finally:
        server.in_flight -= 1


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    app = web.Application()

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _handler(server, request)

    app.router.add_post("/v1/chat/completions", handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


def _conv_bodies(server: FakeServer, conv_id: str) -> list[dict[str, Any]]:
    return [b for b in server.bodies if b.get("conversation_id") == conv_id]


async def test_history_extends_token_for_token(fake: FakeServer, tmp_path: Path) -> None:
    config = WorkloadConfig(url=fake.url, conversations=2, turns=3, gap_mean=0.0, new_tokens=10, max_tokens=5)
    log = tmp_path / "client.jsonl"
    result = await run_workload(config, client_log=log, stats_json=tmp_path / "stats.json")
    assert len(result.records) == 6 and result.status_counts() == {"ok": 6}
    plan_ids = [p.conversation_id for p in make_plans(config)]
    for conv_id in plan_ids:
        bodies = _conv_bodies(fake, conv_id)
        assert len(bodies) == 3
        for prev, nxt in itertools.pairwise(bodies):
            prev_reply = detokenize(generate_reply(0, render_chat(prev["messages"]), 5))
            assert nxt["messages"][:len(prev["messages"])] == prev["messages"]
            assert nxt["messages"][len(prev["messages"])] == {"role": "assistant", "content": prev_reply}
            # the new prompt starts with the previous prompt's tokens plus the reply's tokens
            assert render_chat(nxt["messages"])[:len(render_chat(prev["messages"]))] == render_chat(prev["messages"])
    events = list(read_events(log))
    assert len(events) == 6
    assert {(e.conversation_id, e.turn) for e in events} == {(c, t) for c in plan_ids for t in (1, 2, 3)}
    for ev in events:
        assert ev.source == "client" and ev.status == "ok" and ev.http_status == 200
        assert ev.ttft_ms is not None and ev.duration_ms is not None and ev.ttft_ms <= ev.duration_ms
        assert ev.completion_tokens == 5 and ev.request_id and ev.attrs["scenario"] == "normal"
    turn2 = [e for e in events if e.turn == 2]
    assert all(e.prompt_tokens is not None and e.prompt_tokens > 0 for e in events)
    assert all(e.gap_s is not None for e in turn2)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert len(stats) == 6 and all(tuple(s) == REQUEST_STATS_FIELDS for s in stats)
    assert {s["input_num_turns"] for s in stats} == {1, 3, 5}
    assert all(s["output_num_tokens"] == 5 and s["output_num_chunks"] == 5 for s in stats)


def _plan(conv_id: str, *scenarios: Scenario, send_id: bool = True) -> ConversationPlan:
    return ConversationPlan(conversation_id=conv_id, send_id=send_id,
                            turns=(TurnPlan(), *(TurnPlan(scenario=s) for s in scenarios)))


async def test_scenarios_shape_the_requests(fake: FakeServer, tmp_path: Path) -> None:
    config = WorkloadConfig(url=fake.url, new_tokens=6, max_tokens=8, concurrency=8)
    fake.chunk_delay = 0.02
    plans = [_plan("regen", Scenario.REGENERATE), _plan("dup", Scenario.DUPLICATE),
             _plan("edit", Scenario.NORMAL, Scenario.EDIT),
             _plan("drop", Scenario.DISCONNECT, Scenario.NORMAL), _plan("anon", Scenario.NORMAL, send_id=False)]
    result = await run_workload(config, plans, client_log=tmp_path / "c.jsonl")
    by_conv: dict[str, list[Any]] = {}
    for rec in result.records:
        by_conv.setdefault(rec.event.conversation_id or "", []).append(rec.event)

    regen = _conv_bodies(fake, "regen")
    assert regen[1]["messages"] == regen[0]["messages"]  # the same prompt re-sent
    assert by_conv["regen"][1].attrs["scenario"] == "regenerate"

    dup = _conv_bodies(fake, "dup")
    assert len(dup) == 3 and dup[1] == dup[2]
    assert fake.max_in_flight >= 2
    dup_events = [e for e in by_conv["dup"] if e.turn == 2]
    assert len(dup_events) == 2 and {e.attrs["scenario"] for e in dup_events} == {"duplicate"}
    assert len({e.request_id for e in dup_events}) == 2

    edit = _conv_bodies(fake, "edit")
    reply1 = detokenize(generate_reply(0, render_chat(edit[0]["messages"]), 8))
    assert edit[1]["messages"][1] == {"role": "assistant", "content": reply1}  # turn 2 sent it unchanged
    stripped = edit[2]["messages"][1]
    assert stripped["role"] == "assistant" and stripped["content"] != reply1
    assert reply1.endswith(stripped["content"])  # the tail was kept, the head stripped
    assert len(edit[2]["messages"]) == 5 and edit[2]["messages"][3]["role"] == "assistant"
    # the first message is edited too: no earlier turn's prompt is reproduced (router: prefix_mismatch)
    assert edit[2]["messages"][0]["content"] == "(edited) " + edit[1]["messages"][0]["content"]

    drop_events = sorted(by_conv["drop"], key=lambda e: e.turn)
    assert [e.status for e in drop_events] == ["ok", "disconnected", "ok"]
    assert drop_events[1].ttft_ms is not None
    for _ in range(50):  # the server notices the dropped connection asynchronously
        if fake.disconnects:
            break
        await asyncio.sleep(0.02)
    assert fake.disconnects >= 1

    anon = [b for b in fake.bodies if "conversation_id" not in b]
    assert len(anon) == 2
    assert all(e.attrs.get("conversation_id_sent") is False for e in by_conv["anon"])


async def test_non_streaming_and_duration_limit(fake: FakeServer, tmp_path: Path) -> None:
    config = WorkloadConfig(url=fake.url, conversations=2, turns=3, stream=False, gap_mean=5.0, gap_dist="fixed",
                            duration_limit=0.5)
    result = await run_workload(config)
    assert result.truncated and result.elapsed_s < 2.0
    assert len(result.records) == 2  # only turn 1 of each; turn 2 waits 5 s
    assert all(b["stream"] is False for b in fake.bodies)
    assert all(r.event.status == "ok" and r.stats["output_num_chunks"] == 1 for r in result.records)


async def test_unreachable_server_is_an_error_record(tmp_path: Path) -> None:
    config = WorkloadConfig(url="http://127.0.0.1:9", conversations=1, turns=2, gap_mean=0.0, request_timeout=2.0)
    result = await run_workload(config)
    assert [r.event.status for r in result.records] == ["error", "error"]
    assert "Connect" in str(result.records[0].event.attrs["error"])


def test_cli_reports_unreachable_server(tmp_path: Path) -> None:
    out = CliRunner().invoke(cli, ["workload", "--url", "http://127.0.0.1:9", "-n", "1", "-t", "1",
                                   "-o", str(tmp_path / "c.jsonl")])
    assert out.exit_code == 1 and "every request failed" in out.output
    assert len(list(read_events(tmp_path / "c.jsonl"))) == 1


async def test_cli_names_the_http_error(fake: FakeServer, tmp_path: Path) -> None:
    out = await asyncio.to_thread(CliRunner().invoke, cli, [
        "workload", "--url", fake.url, "--model", "nope", "-n", "1", "-t", "1", "-o", str(tmp_path / "c.jsonl")])
    assert out.exit_code == 1 and "HTTP 404" in out.output and "`nope` does not exist" in out.output
    ok = await asyncio.to_thread(CliRunner().invoke, cli, [
        "workload", "--url", fake.url, "-n", "2", "-t", "2", "--gap-mean", "0", "-o", str(tmp_path / "ok.jsonl"),
        "--stats-json-output", str(tmp_path / "ok.json")])
    assert ok.exit_code == 0, ok.output
    assert "4 requests" in ok.output and "turn 2: TTFT p50" in ok.output
    assert len(json.loads((tmp_path / "ok.json").read_text())) == 4


def test_cli_rejects_bad_options() -> None:
    out = CliRunner().invoke(cli, ["workload", "--long-gap-share", "0.5"])
    assert out.exit_code == 1 and "--long-gap" in out.output


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"turns": 0}, "--turns"),
    ({"url": "127.0.0.1:8000"}, "--url"),
    ({"regenerate_share": 0.6, "edit_share": 0.6}, "add up"),
    ({"disconnect_share": 0.1, "stream": False}, "--stream"),
    ({"gap_dist": "normal"}, "--gap-dist"),
])
def test_config_validation_names_the_option(kwargs: dict[str, Any], needle: str) -> None:
    config = WorkloadConfig(**{"url": "http://127.0.0.1:1", **kwargs})
    with pytest.raises(WorkloadConfigError, match=needle):
        config.validate()


def test_plans_are_seeded_and_follow_the_shares() -> None:
    config = WorkloadConfig(url="http://x", conversations=200, turns=5, no_id_share=0.25, long_gap_share=0.1,
                            long_gap=12.0, regenerate_share=0.2, duplicate_share=0.1, seed=7)
    plans = make_plans(config)
    assert plans == make_plans(config)
    assert plans != make_plans(WorkloadConfig(**{**config.__dict__, "seed": 8}))
    no_id = sum(not p.send_id for p in plans) / len(plans)
    assert 0.15 < no_id < 0.35
    later = [t for p in plans for t in p.turns[1:]]
    assert all(p.turns[0].scenario is Scenario.NORMAL and p.turns[0].gap_s == 0 for p in plans)
    assert 0.14 < sum(t.scenario is Scenario.REGENERATE for t in later) / len(later) < 0.26
    assert 0.05 < sum(t.scenario is Scenario.DUPLICATE for t in later) / len(later) < 0.15
    long = [t for t in later if t.long_gap]
    assert long and all(t.gap_s == 12.0 for t in long)


@pytest.mark.parametrize("dist", ["exp", "uniform", "fixed"])
def test_gap_distributions_have_the_mean(dist: str) -> None:
    rng = random.Random(1)
    gaps = [sample_gap(rng, dist, 2.0) for _ in range(4000)]
    assert abs(sum(gaps) / len(gaps) - 2.0) < 0.15
    assert min(gaps) >= 0


async def test_against_the_real_sim_the_prompt_extends_its_prefix_cache(tmp_path: Path) -> None:
    from kvdiag.demo.processes import Component

    engine = await asyncio.to_thread(Component.start, "prefill", [
        "sim", "prefill", "--port", "0", "--time-scale", "0.01", "--block-size", "16",
        "--log-file", str(tmp_path / "prefill.log")], tmp_path)
    try:
        config = WorkloadConfig(url=engine.url, model="Qwen/Qwen3-32B", conversations=2, turns=3, gap_mean=0.0,
                                new_tokens=20, max_tokens=12)
        result = await run_workload(config, client_log=tmp_path / "client.jsonl")
    finally:
        await asyncio.to_thread(engine.stop)
    assert result.status_counts() == {"ok": 6}
    by_conv: dict[str, list[Any]] = {}
    for rec in result.records:
        by_conv.setdefault(rec.event.conversation_id or "", []).append(rec.event)
    for events in by_conv.values():
        events.sort(key=lambda e: e.turn)
        assert all(e.completion_tokens == 12 for e in events)
        for prev, nxt in itertools.pairwise(events):
            # the engine's own prefix cache covers every full block of the previous prompt: the new
            # prompt extends it token for token
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.completion_tokens
            assert nxt.attrs["cached_tokens"] >= prev.prompt_tokens // 16 * 16 > 0
