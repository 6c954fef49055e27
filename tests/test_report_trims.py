"""Partial reuse in explain, report and advise, on agent traffic through a real router in front of sim P and D.

Ground truth is the router's own ``router_turn`` events (handle, reuse limit, trimmed tokens and why)
and P's reports (wrongly loaded KV). explain must show each turn's numbers and TRIM_INFO's fix, the
report must total them by reason on both table paths (parser and DuckDB, equal), and advise must give
the fix of a reason that dominates. The negative control (the router's rule replaced by "always D's
whole handle") loads KV for other tokens: explain, report and advise must say so.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvdiag.diagnostics.advise import advise
from kvdiag.diagnostics.report import build_report, build_turn_table, load_turn_table, normalize_table
from kvdiag.diagnostics.report_synth import SynthParams, router_events, synthetic_conversations
from kvdiag.diagnostics.terminal import explain_renderables, render_text
from kvdiag.diagnostics.terminal_report import report_renderables
from kvdiag.diagnostics.turn_loader import explain_conversation, load_turns
from kvdiag.router import reuse as router_reuse
from kvdiag.router import reuse_rule
from kvdiag.router.app import start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.schema.events import TurnEvent, read_events
from kvdiag.schema.verdicts import TRIM_INFO, TrimReason
from kvdiag.sim.agent_client import AgentOptions, run_agent_workload
from kvdiag.sim.agent_plan import AgentSpec
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import start_engine
from kvdiag.sim.workload_plan import WorkloadConfig

KEY = ["conversation_id", "turn"]
PARSERS: dict[str, Any] = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True}


def _engine(role: str, events: Path, exact: bool) -> EngineConfig:
    return EngineConfig(role=role, time_scale=0.0, mode="instrumented", block_size=16, kv_recompute_threshold=64,
                        prefix_caching=role == "decode", num_blocks=65_536, events_file=str(events),
                        pull_matching_prefix=exact, **PARSERS)


async def _run(out: Path, profile: str, options: AgentOptions, *, turns: int = 6, exact: bool = True
               ) -> list[TurnEvent]:
    out.mkdir(parents=True, exist_ok=True)
    p = await start_engine(_engine("prefill", out / "prefill-events.jsonl", exact))
    d = await start_engine(_engine("decode", out / "decode-events.jsonl", exact))
    try:
        router = await start_router(RouterConfig(
            prefill=(Upstream("127.0.0.1", p.port),), decode=(Upstream("127.0.0.1", d.port),), host="127.0.0.1",
            port=0, events_file=out / "router-events.jsonl"))
        try:
            config = WorkloadConfig(url=router.url, conversations=2, concurrency=4, stream=True, seed=3,
                                    duration_limit=300.0, request_timeout=60.0)
            spec = AgentSpec(profile=profile, conversations=2, seed=3, scale=0.2, prefix="t", turns=turns)
            result = await run_agent_workload(config, spec, options=options, client_log=out / "client.jsonl")
        finally:
            await router.close()
    finally:
        await p.close()
        await d.close()
    assert result.status_counts() == {"ok": len(result.records)}
    return [e for e in read_events(out / "router-events.jsonl") if e.event == "router_turn"]


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    a, b = (x.sort_values(KEY).reset_index(drop=True) for x in (a, b))
    pd.testing.assert_frame_equal(a, b, check_exact=True)


def _check_run(out: Path, events: list[TurnEvent]) -> pd.DataFrame:
    """explain, report and both table paths against the router's events; return the table."""
    trimmed = [e for e in events if e.trim_reason]
    assert trimmed, "the run should have trimmed some handles"
    files = [str(out)]
    by_turn = {(e.conversation_id, e.turn): e for e in events}
    for conv in load_turns(files):
        for t in conv.turns:
            ev = by_turn[(conv.conversation_id, t.turn)]
            assert (t.handle_tokens, t.reuse_limit_tokens, t.trimmed_tokens, t.trim_reason, t.wrong_kv_tokens) == (
                ev.handle_tokens, ev.reuse_limit_tokens, ev.trimmed_tokens, ev.trim_reason, ev.wrong_kv_tokens)
    ev = max(trimmed, key=lambda e: e.trimmed_tokens or 0)
    assert ev.conversation_id is not None and ev.trim_reason is not None
    conv = explain_conversation(files, ev.conversation_id)
    text = " ".join(render_text(explain_renderables(conv, width=100), 100).split())
    assert f"trimmed {ev.trimmed_tokens:,} ({ev.trim_reason})" in text
    assert TRIM_INFO[TrimReason(ev.trim_reason)].fix in text
    parsed = build_turn_table(load_turns(files))
    _same(normalize_table(load_turn_table(files)), parsed)  # report's table is explain's, row for row
    rep = build_report(load_turn_table(files), None)
    handled = [e for e in events if e.handle_tokens is not None]
    assert rep.trims.handle_turns == len(handled)
    assert rep.trims.trimmed_tokens == sum(e.trimmed_tokens or 0 for e in handled)
    assert dict(rep.trims.by_reason["turns"]) == dict(Counter(e.trim_reason for e in trimmed))
    assert rep.to_json_dict()["trims"]["trimmed_tokens"] == rep.trims.trimmed_tokens
    report_text = " ".join(render_text(report_renderables(rep), 80).split())
    assert f"{rep.trims.trimmed_tokens:,} tokens" in report_text
    return parsed


async def test_reasoning_sent_back_trims_are_explained_and_advised(tmp_path: Path) -> None:
    # The client sends reasoning_content back: the router trims before it or at the reply it cannot prove;
    # advise names the dominant reason's fix.
    events = await _run(tmp_path, "reasoning-chat", AgentOptions(send_reasoning=True))
    df = _check_run(tmp_path, events)
    assert not df["wrong_kv_tokens"].fillna(0).any()
    rep = build_report(df)
    adv = advise(df)
    finding = next(c for c in adv.checks if c.id == "partial_reuse")
    assert not any(c.id == "wrong_kv" for c in adv.checks)
    assert rep.trims.dominant is not None  # one reason carries most of the trimmed tokens on this traffic
    assert finding.fix == TRIM_INFO[TrimReason(rep.trims.dominant)].fix
    assert rep.trims.dominant in finding.message


async def test_wrongly_loaded_kv_is_shown_by_explain_report_and_advise(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def always_full(coverage: Any, view: Any, *, handle_tokens: int, block_size: Any, margin: int = 8) -> Any:
        return reuse_rule.Decision(reuse_rule.Reuse.FULL, handle_tokens)

    # the negative control: the router injects D's whole handle, as the old proxy did, to a stock-like P
    # (exact mode off: P reads positionally)
    monkeypatch.setattr(router_reuse, "decide", always_full)
    events = await _run(tmp_path, "reasoning-chat", AgentOptions(), exact=False)
    wrong = sum(e.wrong_kv_tokens or 0 for e in events)
    assert wrong > 0
    df = build_turn_table(load_turns([str(tmp_path)]))
    assert int(df["wrong_kv_tokens"].fillna(0).sum()) == wrong
    rep = build_report(load_turn_table([str(tmp_path)]))
    assert rep.trims.wrong_kv_tokens == wrong
    assert f"wrongly loaded KV: {wrong:,} tokens" in " ".join(render_text(report_renderables(rep), 100).split())
    bad = next(e for e in events if e.wrong_kv_tokens)
    assert bad.conversation_id is not None
    conv = explain_conversation([str(tmp_path)], bad.conversation_id)
    text = " ".join(render_text(explain_renderables(conv, width=80), 80).split())
    assert f"P loaded {bad.wrong_kv_tokens:,} tokens of KV computed for other tokens" in text
    finding = next(c for c in advise(df).checks if c.id == "wrong_kv")
    assert finding.severity == "error" and f"{wrong:,}" in finding.message


async def test_advise_names_the_fix_of_a_dominant_reason() -> None:
    convs = synthetic_conversations(SynthParams(conversations=80, seed=4, trim_share=0.6,
                                                trim_reasons=("history_reasoning",)))
    df = build_turn_table(convs)
    rep = build_report(df)
    assert rep.trims.dominant == "history_reasoning"
    finding = next(c for c in advise(df).checks if c.id == "partial_reuse")
    assert finding.severity == "warning"
    assert finding.fix == TRIM_INFO[TrimReason.HISTORY_REASONING].fix == (
        "Do not send reasoning_content back, or use --verify-tokens.")
    # expected trims (templates drop the reasoning) are information, not a warning
    convs = synthetic_conversations(SynthParams(conversations=80, seed=4, trim_share=0.6,
                                                trim_reasons=("reasoning_stripped",)))
    finding = next(c for c in advise(build_turn_table(convs)).checks if c.id == "partial_reuse")
    assert finding.severity == "info"
    # no reason over half the trimmed tokens: no fix is pressed on the operator
    convs = synthetic_conversations(SynthParams(conversations=80, seed=4, trim_share=0.6,
                                                trim_reasons=("history_reasoning", "reasoning_stripped",
                                                              "tool_call_rerendered", "reply_edited")))
    rep = build_report(build_turn_table(convs))
    finding = next(c for c in advise(build_turn_table(convs)).checks if c.id == "partial_reuse")
    assert (rep.trims.dominant is None) == (finding.fix == "")


def test_an_unknown_trim_reason_is_a_corrupt_line_on_both_paths(tmp_path: Path) -> None:
    convs = synthetic_conversations(SynthParams(conversations=20, seed=8, trim_share=0.5))
    lines = list(router_events(convs))
    i = next(i for i, line in enumerate(lines) if '"trim_reason"' in line)
    obj = json.loads(lines[i])
    obj["trim_reason"] = "no_such_reason"
    lines[i] = json.dumps(obj)
    path = tmp_path / "router-events.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    table = load_turn_table([str(path)])
    row = table[(table["conversation_id"] == obj["conversation_id"]) & (table["turn"] == obj["turn"])]
    assert row["trim_reason"].isna().all() and row["trimmed_tokens"].isna().all()  # the line was not read
    assert table["trimmed_tokens"].notna().sum() == sum(1 for line in lines if '"trim_reason"' in line) - 1
