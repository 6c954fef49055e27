"""The probe through the router: its TTL gauges, and a three-turn conversation judged by its own counters.

The router counts every turn by lookup result (``kvdiag_lookups_total``), verdict
(``kvdiag_turns_total{outcome}``) and missing-metadata reason, so the difference between two scrapes
around one of the check's turns is that turn's verdict, as long as no other traffic moved the same
counters meanwhile (then the verdicts are reported as "cannot tell").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.check.client import Client, StreamReply
from kvdiag.check.conversation import Conversation
from kvdiag.check.engines import EXPIRED, FAILED, FIX_BIDIR_D, FIX_BIDIR_P, FIX_STREAM, XFER_COUNT, EngineFacts
from kvdiag.check.facts import EXPIRY_SAFETY_MARGIN_S, router_ttl_problem, suggest_entry_ttl
from kvdiag.check.findings import Findings, Status, Unreachable
from kvdiag.check.scrape import Scrape, delta, delta_by_label

CHAT: Final = "/v1/chat/completions"
TURNS: Final = "kvdiag_turns_total"
LOOKUPS: Final = "kvdiag_lookups_total"
MISSING: Final = "kvdiag_missing_metadata_total"
TRANSFER_FAILURES: Final = "kvdiag_transfer_failures_total"
REQUESTS: Final = "kvdiag_router_requests_total"
REPORTED_TOKENS: Final = "kvdiag_prompt_tokens_total"  # only an instrumented P's report feeds it
ENTRY_TTL: Final = "kvdiag_router_entry_ttl_seconds"
DECODER_TTL: Final = "kvdiag_decoder_kv_blocks_ttl_seconds"
ROUTER_TURNS: Final = 3
FIX_ID: Final = ("send a top-level conversation_id in every request (openai SDK: extra_body={'conversation_id': "
                 "...}; vLLM's benchmark: --send-conversation-id) or an X-Conversation-Id header, and let gateways "
                 "in front of the router pass it through")
FIX_STATE: Final = ("run router replicas on one shared store (--state redis://...); with the memory store, a "
                    "restart or another replica forgets every conversation")


@dataclass
class RouterTurn:
    """One of the check's turns through the router, and what the router's counters say about it."""

    number: int
    reply: StreamReply
    lookups: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, float] = field(default_factory=dict)
    missing: dict[str, float] = field(default_factory=dict)
    failures: dict[str, float] = field(default_factory=dict)
    turns_moved: float = 0.0
    requests_moved: float = 0.0
    reported_read_tokens: float | None = None  # None: P sent no kvdiag report (stock P)

    @property
    def lookup(self) -> str | None:
        """The lookup result, if exactly one turn moved the counters."""
        return next(iter(self.lookups)) if len(self.lookups) == 1 else None

    @property
    def outcome(self) -> str | None:
        """The verdict, if exactly one turn moved the counters."""
        return next(iter(self.outcomes)) if len(self.outcomes) == 1 else None

    def describe(self) -> str:
        """One evidence line."""
        return (f"router turn {self.number}: lookup {_fmt(self.lookups)}, outcome {_fmt(self.outcomes)}"
                + (f", missing metadata {_fmt(self.missing)}" if self.missing else "")
                + (f", transfer failures {_fmt(self.failures)}" if self.failures else ""))


def _fmt(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} +{v:g}" for k, v in sorted(counts.items())) or "none"


@dataclass
class RouterProbe:
    """One probe of a router base URL (with the engine facts, when P and D were probed directly)."""

    client: Client
    url: str
    findings: Findings
    facts: EngineFacts | None = None
    model: str | None = None
    reply_tokens: int = 96
    metrics_wait: float = 3.0
    p_url: str | None = None
    scrape: Scrape | None = None
    turns: list[RouterTurn] = field(default_factory=list)
    read_evidence: list[str] = field(default_factory=list)
    p_reads: float | None = None  # P's NIXL transfers during the router's turns (when --prefill is given)

    async def discover(self) -> None:
        """/health and /metrics; the TTL checks."""
        health = await self.client.get("router", self.url + "/health")
        if health.status >= 500 or (health.status == 200 and isinstance(health.body, dict)
                                    and health.body.get("status") not in (None, "ok")):
            self.findings.add("router_state", Status.FAIL,
                              f"/health answered HTTP {health.status} {health.text[:120]}: the router's store is "
                              "unreachable, so no turn can reuse KV", "check the router's --state (Redis) URL and "
                              "that Redis answers from the router's pod")
        elif health.status != 200:
            raise Unreachable("router", self.url, f"GET /health answered HTTP {health.status}")
        self.scrape = await self.client.scrape("router", self.url)
        if self.scrape is None:
            self.findings.add("router_reachable", Status.WARN, f"{self.url} answers, but /metrics is missing: "
                              "its verdicts and TTLs cannot be read (not a kvdiag router?)",
                              "run kvdiag router (a drop-in for vLLM's disagg_proxy_multiturn.py)")
        else:
            self.findings.add("router_reachable", Status.PASS, f"{self.url} answers")
        self._ttls()

    def _ttls(self) -> None:
        entry = self.scrape.total(ENTRY_TTL) if self.scrape is not None else None
        copy = self.scrape.total(DECODER_TTL) if self.scrape is not None else None
        measured = self.facts.decode_ttl if self.facts is not None else None
        if copy is not None and measured is not None:
            if abs(copy - measured) > max(2.0, 0.02 * measured):
                self.findings.add("router_decode_ttl", Status.FAIL,
                                  f"the router assumes D keeps blocks {copy:g} s, but D keeps them about "
                                  f"{measured:.0f} s", f"start the router with --decoder-kv-blocks-ttl "
                                  f"{measured:.0f} (D's decoder_kv_blocks_ttl) and --entry-ttl below "
                                  f"{measured - EXPIRY_SAFETY_MARGIN_S:.0f}", [f"router: {DECODER_TTL} {copy:g}"])
            else:
                self.findings.add("router_decode_ttl", Status.PASS,
                                  f"{copy:g} s, as D measured (about {measured:.0f} s)")
        elif copy is not None:
            self.findings.add("router_decode_ttl", Status.UNKNOWN,
                              f"cannot tell: the router assumes {copy:g} s; D's real TTL is measured only with "
                              "--decode (and its side channel reachable)")
        if entry is None or copy is None:
            self.findings.add("router_ttl", Status.UNKNOWN,
                              f"cannot tell: the router's /metrics has no {ENTRY_TTL} / {DECODER_TTL} gauges")
            return
        copy_ok = self.findings.status("router_decode_ttl") is Status.PASS
        effective = copy if measured is None or copy_ok else min(copy, float(round(measured)))
        problem = router_ttl_problem(entry, effective)
        evidence = [f"router: {ENTRY_TTL} {entry:g}, {DECODER_TTL} {copy:g}"]
        if problem is None:
            self.findings.add("router_ttl", Status.PASS, f"entry TTL {entry:g} s < {effective:g} s - "
                              f"{EXPIRY_SAFETY_MARGIN_S:g} s", None, evidence)
            return
        if effective <= EXPIRY_SAFETY_MARGIN_S:
            fix = "raise D's decoder_kv_blocks_ttl (vLLM's default is 480 s) and the router's copy of it"
        else:
            fix = (f"start the router with --entry-ttl {suggest_entry_ttl(effective):g} "
                   f"(below {effective:g} - {EXPIRY_SAFETY_MARGIN_S:g})")
        self.findings.add("router_ttl", Status.FAIL, problem, fix, evidence)

    async def conversation(self) -> None:
        """Three streamed turns with a conversation id; each judged by the router's counter deltas."""
        conv = Conversation()
        p_before = await self._p_scrape()
        for number in range(1, ROUTER_TURNS + 1):
            before = self.scrape or Scrape()
            body: dict[str, Any] = {"messages": conv.messages, "max_tokens": self.reply_tokens,
                                    "min_tokens": self.reply_tokens, "stream": True,
                                    "stream_options": {"include_usage": True},
                                    "conversation_id": conv.conversation_id}
            if self.model is not None:
                body["model"] = self.model
            reply = await self.client.post_stream("router", self.url + CHAT, body)
            after = await self._scrape_after(before)
            turn = self._turn(number, reply, before, after)
            self.turns.append(turn)
            self.scrape = after or self.scrape
            if reply.status != 200 or reply.error is not None or not reply.content:
                why = f"HTTP {reply.status} {reply.error_body[:160]}" if reply.status != 200 else (
                    reply.error or f"no text (finish_reason {reply.finish_reason})")
                self.findings.add("pd_handoff", Status.FAIL, f"turn {number} through the router failed: {why}",
                                  "check the router's log and its P/D upstreams", [turn.describe()])
                for check_id in ("conversation_id", "router_state", "request_ids"):
                    self.findings.skip(check_id, f"blocked: turn {number} through the router failed")
                return
            conv.extend(reply.content)
        p_after = await self._p_scrape()
        self._judge(p_before, p_after)

    async def _p_scrape(self) -> Scrape | None:
        return await self.client.scrape("prefill", self.p_url) if self.p_url else None

    async def _scrape_after(self, before: Scrape) -> Scrape | None:
        deadline = time.monotonic() + self.metrics_wait
        while True:
            after = await self.client.scrape("router", self.url)
            if after is None or (delta(before, after, TURNS) or 0) >= 1 or time.monotonic() > deadline:
                return after
            await asyncio.sleep(0.05)

    @staticmethod
    def _turn(number: int, reply: StreamReply, before: Scrape, after: Scrape | None) -> RouterTurn:
        turn = RouterTurn(number, reply)
        if after is None:
            return turn
        turn.lookups = delta_by_label(before, after, LOOKUPS, "result")
        turn.outcomes = delta_by_label(before, after, TURNS, "outcome")
        turn.missing = delta_by_label(before, after, MISSING, "reason")
        turn.failures = delta_by_label(before, after, TRANSFER_FAILURES, "failure_type")
        turn.turns_moved = delta(before, after, TURNS) or 0.0
        reported = delta_by_label(before, after, REPORTED_TOKENS, "source")
        if reported:
            turn.reported_read_tokens = reported.get("remote_read", 0.0)
        requests = delta_by_label(before, after, REQUESTS, "endpoint")
        turn.requests_moved = sum(v for k, v in requests.items() if k not in ("health", "metrics"))
        return turn

    # --- verdicts -----------------------------------------------------------------------------
    def _judge(self, p_before: Scrape | None, p_after: Scrape | None) -> None:
        add = self.findings.add
        evidence = [t.describe() for t in self.turns]
        self.read_evidence = list(evidence)
        if p_before is not None and p_after is not None:
            for name in (XFER_COUNT, FAILED, EXPIRED):
                moved = delta(p_before, p_after, name)
                if moved is not None:
                    self.read_evidence.append(f"P: {name} {moved:+g} during the router's turns")
            self.p_reads = delta(p_before, p_after, XFER_COUNT)
        self._request_ids()
        extra = sum(max(0.0, t.requests_moved - 1) for t in self.turns)
        if extra or any(t.turns_moved > 1 for t in self.turns):
            for check_id in ("conversation_id", "router_state", "d2p_read"):
                add(check_id, Status.UNKNOWN, f"cannot tell through the router: other traffic ({extra:g} requests) "
                    "moved its counters during the check", "rerun when the router is idle, or give --prefill "
                    "and --decode", evidence)
            return
        if not self.turns or self.turns[0].lookup is None:
            add("conversation_id", Status.UNKNOWN, f"cannot tell: the router's /metrics has no {LOOKUPS} deltas",
                None, evidence)
            return
        lookups = [t.lookup for t in self.turns]
        if "no_id" in lookups:
            add("conversation_id", Status.FAIL, "the router saw no conversation id on turn(s) "
                f"{', '.join(str(t.number) for t in self.turns if t.lookup == 'no_id')}, though the check sent "
                "one: something between the client and the router drops it (verdict no_conversation_id)",
                FIX_ID, evidence)
            self.findings.skip("router_state", "blocked: the router never saw the conversation id")
            self.findings.skip("d2p_read", "blocked: the router never saw the conversation id")
            return
        add("conversation_id", Status.PASS, "the router recognised the conversation id on every turn", None, evidence)
        for turn in self.turns[1:]:
            if not self._later_turn(turn, evidence):
                return
        add("router_state", Status.PASS, "the router found D's handle on every later turn", None, evidence)
        outcomes = [t.outcome for t in self.turns[1:]]
        self._outcomes(outcomes, evidence)

    def _later_turn(self, turn: RouterTurn, evidence: list[str]) -> bool:
        add = self.findings.add
        lookup = turn.lookup
        if lookup == "hit":
            return True
        if lookup == "lost":
            add("router_state", Status.FAIL, f"turn {turn.number}: the router did not know the conversation "
                "(router_state_lost): a restart with the memory store, or a replica that does not share the store",
                FIX_STATE, evidence)
        elif lookup == "expired":
            add("router_state", Status.FAIL, f"turn {turn.number}: the handle had expired within seconds "
                "(router_entry_expired): the router's --entry-ttl is far too short", "raise --entry-ttl "
                "(default decoder_kv_blocks_ttl - 30 s)", evidence)
        elif lookup == "miss" and "not_streamed" in turn.missing:
            add("stream_kv_params", Status.FAIL, f"turn {turn.number}: D's stream carried no kv_transfer_params "
                "(metadata_not_returned, not_streamed)", FIX_STREAM, evidence)
            add("router_state", Status.PASS, "the router kept the conversation; D returned nothing to keep")
        elif lookup == "miss" and "bidirectional_off_on_decode" in turn.missing:
            add("bidirectional_decode", Status.FAIL, f"turn {turn.number}: D returned null kv_transfer_params "
                "(metadata_not_returned, bidirectional_off_on_decode)", FIX_BIDIR_D, evidence)
            add("router_state", Status.PASS, "the router kept the conversation; D returned nothing to keep")
        else:
            add("router_state", Status.WARN, f"turn {turn.number}: lookup {lookup}, missing metadata "
                f"{_fmt(turn.missing)}: the router had no handle to give P", "explain the turn with "
                "kvdiag explain --conversation-id kvdiag-check-… on the router's events", evidence)
        self.findings.skip("d2p_read", "blocked: the router had no handle for P")
        return False

    def _outcomes(self, outcomes: list[str | None], evidence: list[str]) -> None:
        add = self.findings.add
        if all(o == "remote_hit" for o in outcomes):
            self._remote_hits(evidence)
            return
        worst = next(o for o in outcomes if o != "remote_hit")
        if worst == "feature_disabled_on_prefill":
            add("bidirectional_prefill", Status.FAIL, "P ignored D's handle (feature_disabled_on_prefill)",
                FIX_BIDIR_P, evidence)
            self.findings.skip("d2p_read", "blocked: P does not read from D")
        elif worst in ("expired_remote_read", "transfer_failed"):
            add("bidirectional_prefill", Status.PASS, "P tried to read D's blocks", None, evidence)
            add("d2p_read", Status.FAIL, f"the router's later turns ended {worst}", "see the d2p_read fix from a "
                "direct probe (--prefill/--decode) for the cause", self.read_evidence)
        elif worst in ("local_hit", "below_threshold"):
            add("d2p_read", Status.WARN, f"P read nothing from D ({worst}): its own cache covered the turn",
                "rerun with a larger --reply-tokens than P's kv_recompute_threshold", self.read_evidence)
        else:
            add("d2p_read", Status.UNKNOWN, f"cannot tell: the router's verdict was {worst} (a stock P reports no "
                "outcome; give --prefill to read its counters)", None, self.read_evidence)

    def _remote_hits(self, evidence: list[str]) -> None:
        """remote_hit on every later turn: P's report, or P's NIXL counters, must confirm a router inference."""
        add = self.findings.add
        reported = [t.reported_read_tokens for t in self.turns[1:]]
        if all(r is not None and r > 0 for r in reported):
            how = "P's reports"
        elif self.p_reads is not None and self.p_reads >= len(self.turns) - 1:
            how = "P's vllm:nixl_* counters"
        elif self.p_reads is not None:
            add("bidirectional_prefill", Status.FAIL, f"the router counted remote_hit on turns 2-{ROUTER_TURNS} from "
                f"P's cached_tokens, but P's NIXL counters moved {self.p_reads:g} times: P's own prefix cache "
                "answered, P did not read from D", FIX_BIDIR_P, self.read_evidence)
            return
        else:
            why = (f"cannot tell: the router counted remote_hit on turns 2-{ROUTER_TURNS}, inferred from P's "
                   "cached_tokens (a stock P sends no report), which P's own prefix cache fills too")
            fix = "give --prefill (and --decode) to confirm with P's counters"
            add("bidirectional_prefill", Status.UNKNOWN, why, fix, evidence)
            add("d2p_read", Status.UNKNOWN, why, fix, self.read_evidence)
            return
        add("bidirectional_prefill", Status.PASS, "P read D's blocks on every later router turn", None, evidence)
        add("d2p_read", Status.PASS, f"turns 2-{ROUTER_TURNS} through the router were remote_hit ({how})", None,
            self.read_evidence)

    def _request_ids(self) -> None:
        first = self.turns[0].reply if self.turns else None
        if first is None:
            return
        rid = first.headers.get("x-request-id")
        if not rid:
            self.findings.add("request_ids", Status.WARN, "the router returned no X-Request-Id header: client "
                              "logs cannot be joined to the engines' lines", "run kvdiag router, which returns it")
        elif first.response_id not in (f"chatcmpl-{rid}", None):
            self.findings.add("request_ids", Status.WARN,
                              f"D's response id {first.response_id} is not chatcmpl-{rid}: the engines do not use "
                              "the router's X-Request-Id, so explain cannot join router and engine lines",
                              "use a vLLM that takes X-Request-Id as the request id (0.6 or newer)")
        else:
            self.findings.add("request_ids", Status.PASS, f"X-Request-Id {rid} -> response id {first.response_id}")
