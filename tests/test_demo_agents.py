"""The demo's agent views: the modelled TTFT is what the engines' time model spent, and the article check can fail."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvdiag.demo.agent_phases import ARTICLE_PROMPTS, ARTICLE_RECOMPUTE_ID, ARTICLE_REUSE_ID, article_plan
from kvdiag.demo.agent_summary import modelled_ttft_ms, summarize_agents
from kvdiag.schema.events import TurnEvent, read_events
from kvdiag.sim.agent_plan import TOOLS, Step
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.emulated_engine import Engine, RequestState
from kvdiag.sim.pd_driver import run_turn
from kvdiag.sim.server import start_engine
from kvdiag.sim.timemodel import get_profile
from kvdiag.sim.tokenizer import generate_text


async def test_modelled_ttft_is_what_the_engines_time_model_spent(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    spent: dict[tuple[str, str], list[float]] = {}
    original = Engine.advance

    async def record(self: Engine, state: RequestState, ms: float) -> None:
        spent.setdefault((self.config.role, state.request_id or ""), []).append(ms)
        await original(self, state, ms)

    monkeypatch.setattr(Engine, "advance", record)
    p = await start_engine(EngineConfig(role="prefill", time_scale=0.0, mode="instrumented", prefix_caching=False,
                                        events_file=str(tmp_path / "p.jsonl")))
    d = await start_engine(EngineConfig(role="decode", time_scale=0.0, mode="instrumented",
                                        events_file=str(tmp_path / "d.jsonl")))
    try:
        async with aiohttp.ClientSession() as session:
            messages: list[dict[str, Any]] = [{"role": "user", "content": generate_text(1, 3000)}]
            t1 = await run_turn(session, p.url, d.url, messages, None, "r1", max_tokens=12)
            messages += [{"role": "assistant", "content": t1.reply}, {"role": "user", "content": generate_text(2, 900)}]
            await run_turn(session, p.url, d.url, messages, t1.d_params, "r2", max_tokens=12)
            await run_turn(session, p.url, d.url, messages, None, "r3", max_tokens=12)  # the same turn recomputed
    finally:
        await p.close()
        await d.close()
    p_ev = {e.request_id: e for e in read_events(tmp_path / "p.jsonl") if e.event == "prefill_request"}
    d_ev = {e.request_id: e for e in read_events(tmp_path / "d.jsonl") if e.event == "decode_request"}
    profile = get_profile("qwen3-32b")
    assert (p_ev["r2"].remote_read_tokens or 0) > 3000 and not p_ev["r3"].remote_read_tokens
    for rid in ("r1", "r2", "r3"):
        # P spends everything before its single token; D its reads, its prefill and one decode step
        d_calls = spent[("decode", rid)]
        first_decode = next(i for i, ms in enumerate(d_calls) if ms == profile.decode_step_ms and i > 0)
        truth = sum(spent[("prefill", rid)]) + sum(d_calls[:first_decode + 1])
        assert modelled_ttft_ms(p_ev[rid], d_ev[rid], profile) == pytest.approx(truth, abs=0.01)
    assert modelled_ttft_ms(p_ev["r3"], d_ev["r3"], profile) > modelled_ttft_ms(p_ev["r2"], d_ev["r2"], profile)


def test_the_article_plan_is_sized_to_its_prompt_lengths() -> None:
    plan = article_plan("x", send_id=True)
    assert [t.step for t in plan.turns] == [Step.TASK] + [Step.TOOL_RESULTS] * (len(ARTICLE_PROMPTS) - 1)
    assert plan.tools and len(TOOLS) == 4 and all(t.reply.tool_calls == 1 for t in plan.turns)
    assert not article_plan("y", send_id=False).send_id


def _write(path: Path, events: Iterable[TurnEvent]) -> None:
    path.write_text("".join(e.to_json() + "\n" for e in events))


def _article_logs(out: Path, reused_read: int) -> None:
    """Two article turns at 2k and 24k tokens; the reused conversation reads ``reused_read`` of each prompt."""
    client, router, p, d = [], [], [], []
    for conv in (ARTICLE_REUSE_ID, ARTICLE_RECOMPUTE_ID):
        for turn, prompt in ((1, 1_843), (2, 2_048), (3, 24_576)):
            rid = f"{conv}-{turn}"
            read = int(prompt * reused_read / 100) // 16 * 16 if conv == ARTICLE_REUSE_ID and turn > 1 else 0
            new = max(1, round(prompt * 0.28))
            client.append(TurnEvent(ts=1.0, source="client", event="client_turn", conversation_id=conv, turn=turn,
                                    request_id=rid, prompt_tokens=prompt, ttft_ms=100.0, status="ok",
                                    attrs={"profile": "article"}))
            router.append(TurnEvent(ts=1.0, source="router", event="router_turn", conversation_id=conv, turn=turn,
                                    request_id=rid, outcome="remote_hit" if read else "first_turn",
                                    remote_read_tokens=read, wrong_kv_tokens=0))
            xfer = get_profile("qwen3-32b").transfer_ms(read) if read else None
            p.append(TurnEvent(ts=1.0, source="prefill", event="prefill_request", request_id=rid, prompt_tokens=prompt,
                               computed_tokens=prompt - read, remote_read_tokens=read, transfer_ms=xfer,
                               wrong_kv_tokens=0))
            d.append(TurnEvent(ts=1.0, source="decode", event="decode_request", request_id=rid, prompt_tokens=prompt,
                               computed_tokens=1, transfer_ms=get_profile("qwen3-32b").transfer_ms(new)))
    # an agent scenario turn that loaded wrong KV: the summary must say so
    client.append(TurnEvent(ts=2.0, source="client", event="client_turn", conversation_id="a", turn=2,
                            request_id="a2", status="ok", attrs={"profile": "coding-agent"}))
    router.append(TurnEvent(ts=2.0, source="router", event="router_turn", conversation_id="a", turn=2,
                            request_id="a2", outcome="remote_hit", remote_read_tokens=64, trimmed_tokens=30,
                            trim_reason="reasoning_stripped", wrong_kv_tokens=5))
    p.append(TurnEvent(ts=2.0, source="prefill", event="prefill_request", request_id="a2", prompt_tokens=100,
                       computed_tokens=36, remote_read_tokens=64, wrong_kv_tokens=5))
    _write(out / "client.jsonl", client)
    _write(out / "agent-router-events.jsonl", router)
    _write(out / "agent-prefill-events.jsonl", p)
    _write(out / "agent-decode-events.jsonl", d)


def test_the_article_check_passes_on_reuse_and_fails_without_it(tmp_path: Path) -> None:
    _article_logs(tmp_path, reused_read=72)  # 28% of each prompt is new, as in the time model's calibration
    good = summarize_agents(tmp_path)
    assert [t.prompt_tokens for t in good.article] == [2_048, 24_576]
    assert [round(t.speedup, 2) for t in good.article] == [1.09, 1.83]
    assert [c.within for c in good.checks] == [False, True]  # 2k at 28% new: -16%, outside 15%
    assert good.engine_wrong_kv_tokens == 5 and good.wrong_kv_tokens == 5
    row = next(r for r in good.scenarios if r.scenario == "coding-agent")
    assert row.later_turns == 1 and row.reused_tokens == 64 and row.reasons["reasoning_stripped"] == 1
    assert good.reasons == {"reasoning_stripped": (1, 30)}
    _article_logs(tmp_path, reused_read=90)  # a short new part at 2k (10%) is what the demo's plan uses
    assert summarize_agents(tmp_path).checks[0].within
    _article_logs(tmp_path, reused_read=0)  # nothing reused: no speedup, the check fails
    bad = summarize_agents(tmp_path)
    assert all(abs(t.speedup - 1.0) < 1e-9 for t in bad.article) and not any(c.within for c in bad.checks)
    assert not bad.article_ok and good.article_ok is False
