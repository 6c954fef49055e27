"""The demo's phases: conversations and engine switches that together produce every verdict.

Phase 1 runs the workload-driven scenarios concurrently (regenerate, duplicate, edit, disconnect,
no id, long replies, short replies, and two long gaps: one past D's deadline minus P's 5 s margin,
one past the router TTL). Phase 2 flips engine switches at runtime through the sims' admin
endpoints, one at a time, each around a fresh two-turn conversation. Phase 3 restarts the router
and sends later turns it no longer knows. docs/design.md Contract 4 is the map.

Usage::

    await run_phases(runner, ctx)   # runner: a WorkloadRunner pointed at the router
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.verdicts import Verdict
from kvdiag.sim.workload import Conversation, WorkloadRunner
from kvdiag.sim.workload_plan import ConversationPlan, Scenario, TurnPlan

_logger = logging.getLogger(__name__)


class PhaseError(KVDiagError, RuntimeError):
    """A demo phase could not drive the testbed (an admin call failed, a component died)."""


@dataclass(frozen=True)
class DemoTimings:
    """TTLs and gaps of the demo (seconds). Router TTL > D TTL - 5 on purpose: it yields expired_remote_read."""

    decode_ttl: float = 10.0
    router_ttl: float = 9.0
    expired_read_gap: float = 6.5  # D's deadline is then under P's 5 s margin, the router entry still valid
    router_expired_gap: float = 9.8  # past the router TTL


@dataclass
class PhaseContext:
    """What the phases need from the orchestrator: admin URLs and a router restart hook."""

    prefill_url: str
    decode_url: str
    restart_router: Callable[[], Awaitable[str]]  # returns the (same) router URL once it is ready again
    timings: DemoTimings = field(default_factory=DemoTimings)
    keep_going: bool = False
    notes: list[str] = field(default_factory=list)


def _plan(name: str, turns: list[TurnPlan], *, send_id: bool = True, max_tokens: int | None = None,
          expect: Verdict | None = None) -> ConversationPlan:
    tags = {"demo_expect": expect.value} if expect is not None else {}
    return ConversationPlan(conversation_id=f"demo-{name}", turns=tuple(turns), send_id=send_id,
                            max_tokens=max_tokens, tags=tags)


def phase1_plans(timings: DemoTimings, *, long_reply: int, short_reply: int) -> list[ConversationPlan]:
    """The concurrent workload scenarios; ``long_reply``/``short_reply`` sit either side of P's threshold."""
    normal, quick = TurnPlan(), TurnPlan(gap_s=0.05)
    return [
        _plan("remote", [normal, quick, TurnPlan(gap_s=0.05, tool_result=True)], max_tokens=long_reply,
              expect=Verdict.REMOTE_HIT),
        _plan("short", [normal, quick, quick], max_tokens=short_reply, expect=Verdict.BELOW_THRESHOLD),
        _plan("regen", [normal, TurnPlan(gap_s=0.05, scenario=Scenario.REGENERATE)], max_tokens=long_reply,
              expect=Verdict.LOCAL_HIT),
        _plan("dup", [normal, TurnPlan(gap_s=0.05, scenario=Scenario.DUPLICATE)], max_tokens=long_reply,
              expect=Verdict.CONCURRENT_TURN),
        _plan("edit", [normal, quick, TurnPlan(gap_s=0.05, scenario=Scenario.EDIT)], max_tokens=long_reply,
              expect=Verdict.PREFIX_MISMATCH),
        _plan("drop", [normal, TurnPlan(gap_s=0.05, scenario=Scenario.DISCONNECT), TurnPlan(gap_s=0.3)],
              max_tokens=long_reply, expect=Verdict.METADATA_NOT_RETURNED),
        _plan("anon", [normal, quick], send_id=False, expect=Verdict.NO_CONVERSATION_ID),
        _plan("late", [normal, TurnPlan(gap_s=timings.expired_read_gap, long_gap=True)], max_tokens=long_reply,
              expect=Verdict.EXPIRED_REMOTE_READ),
        _plan("later", [normal, TurnPlan(gap_s=timings.router_expired_gap, long_gap=True)], max_tokens=long_reply,
              expect=Verdict.ROUTER_ENTRY_EXPIRED),
    ]


def produced_by(timings: DemoTimings) -> dict[Verdict, str]:
    """What in the demo produces each verdict (the summary's last column)."""
    margin = timings.decode_ttl - 5.0
    return {
        Verdict.FIRST_TURN: "turn 1 of every conversation",
        Verdict.REMOTE_HIT: "later turns, long replies",
        Verdict.LOCAL_HIT: "client re-sends a turn",
        Verdict.BELOW_THRESHOLD: "short replies (< threshold)",
        Verdict.NO_CONVERSATION_ID: "client sends no id",
        Verdict.METADATA_NOT_RETURNED: "client dropped last turn",
        Verdict.ROUTER_STATE_LOST: "router restarted",
        Verdict.ROUTER_ENTRY_EXPIRED: f"gap {timings.router_expired_gap:g} s > router TTL {timings.router_ttl:g} s",
        Verdict.EXPIRED_REMOTE_READ: f"gap {timings.expired_read_gap:g} s > D TTL-5 = {margin:g} s",
        Verdict.TRANSFER_FAILED: "P: NIXL handshake fails",
        Verdict.FEATURE_DISABLED_ON_PREFILL: "P: bidirectional off",
        Verdict.PREFIX_MISMATCH: "client edits its history",
        Verdict.CONCURRENT_TURN: "duplicate while in flight",
        Verdict.REQUEST_FAILED: "D: HTTP 500",
    }


# Phase 2: (conversation name, engine ("prefill"/"decode"), admin path, switches on, switches off, verdict)
FaultStep = tuple[str, str, str, dict[str, Any], dict[str, Any], Verdict]


async def admin_post(session: aiohttp.ClientSession, base_url: str, path: str, body: dict[str, Any]) -> None:
    """POST a testbed admin call to an engine; raise PhaseError with the server's answer on failure."""
    try:
        async with session.post(f"{base_url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status >= 400:
                raise PhaseError(f"POST {base_url}{path} {body} -> HTTP {resp.status}: {(await resp.text())[:200]}")
    except aiohttp.ClientError as exc:
        raise PhaseError(f"POST {base_url}{path} failed: {exc}") from exc


async def run_fault_step(runner: WorkloadRunner, ctx: PhaseContext, step: FaultStep, index: int,
                         long_reply: int) -> None:
    """Turn 1 healthy, switch the fault on, turn 2 (the verdict), switch it off again."""
    name, engine, path, on, off, verdict = step
    conv = runner.new_conversation(_plan(name, [], max_tokens=long_reply, expect=verdict), 100 + index)
    await runner.run_turn(conv, 1, TurnPlan())
    base = ctx.prefill_url if engine == "prefill" else ctx.decode_url
    await admin_post(runner.session, base, path, on)
    try:
        await runner.run_turn(conv, 2, TurnPlan(gap_s=0.05))
    finally:
        if off:
            await admin_post(runner.session, base, path, off)


async def _guard(ctx: PhaseContext, label: str, work: Awaitable[Any]) -> None:
    try:
        await work
    except PhaseError as exc:
        if not ctx.keep_going:
            raise
        ctx.notes.append(f"{label}: {exc}")
        _logger.warning("demo phase %s failed: %s", label, exc)


async def run_phases(runner: WorkloadRunner, ctx: PhaseContext, fault_steps: list[FaultStep], *,
                     long_reply: int, short_reply: int) -> dict[str, Conversation]:
    """Run phases 1-3; return the conversations by id (their histories are the demo's client side)."""
    plans = phase1_plans(ctx.timings, long_reply=long_reply, short_reply=short_reply)
    convs = {p.conversation_id: runner.new_conversation(p, i) for i, p in enumerate(plans)}
    await asyncio.gather(*(runner.run_conversation(c) for c in convs.values()))
    for index, step in enumerate(fault_steps):
        await _guard(ctx, f"fault {step[0]}", run_fault_step(runner, ctx, step, index, long_reply))
    # Phase 3: a restarted router (memory store) meets later turns of conversations it served before.
    runner.url = await ctx.restart_router()
    for name in ("demo-remote", "demo-short"):
        conv = convs[name]
        await runner.run_turn(conv, len(conv.plan.turns) + 1, TurnPlan())
    return convs
