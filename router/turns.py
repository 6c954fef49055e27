"""Per-turn bookkeeping: which verdict the router decides, and the turn's record.

:func:`decide_lookup` turns a store claim into the router's view of the turn (Contract 4: the
router decides every verdict for which it offered no handle). :class:`TurnState` collects what
the two legs observed; :func:`prefill_verdict` says what P's answer means when a handle was
offered; :meth:`TurnState.to_event` builds the ``router_turn`` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.router.config import P_EXPIRY_SAFETY_MARGIN
from kvdiag.router.reuse_rule import Decision, Reuse
from kvdiag.router.security import ID_HASH_SCHEME
from kvdiag.router.store import Claim, Handle
from kvdiag.schema.events import PrefillReport, TurnEvent, now_ts
from kvdiag.schema.verdicts import REUSED_VERDICTS, TrimReason, Verdict

# Lookup results (the catalog's LOOKUP_RESULTS label values).
HIT: Final = "hit"
MISS: Final = "miss"
EXPIRED: Final = "expired"
NO_ID: Final = "no_id"
CONCURRENT: Final = "concurrent"
PREFIX_MISMATCH: Final = "prefix_mismatch"
LOST: Final = "lost"


@dataclass(frozen=True)
class Lookup:
    """The router's view before P is called: the handle to inject (hit) or why there is none."""

    result: str
    turn: int
    handle: Handle | None = None
    verdict: Verdict | None = None  # None on a hit: P's answer decides
    reason: str | None = None
    entry_age_s: float | None = None
    gap_s: float | None = None
    trim_reason: TrimReason | None = None  # why D's handle was not injected (in full)


def decide_lookup(*, has_id: bool, claim: Claim | None, decision: Decision | None, earlier_turns: int,
                  now: float, entry_ttl: float, store_error: str | None = None) -> Lookup:
    """Decide the lookup result, turn number and (when no handle is offered) the verdict.

    ``decision`` is the reuse rule's answer for the claimed handle (None when there is none).
    """
    if not has_id:
        turn = earlier_turns + 1
        if earlier_turns == 0:
            return Lookup(NO_ID, turn, verdict=Verdict.FIRST_TURN, reason="first turn (no conversation_id sent)")
        return Lookup(NO_ID, turn, verdict=Verdict.NO_CONVERSATION_ID,
                      reason=f"request carries {earlier_turns} earlier replies but no conversation_id")
    if claim is None:
        return Lookup(LOST, earlier_turns + 1, verdict=Verdict.ROUTER_STATE_LOST,
                      reason=f"conversation store unavailable: {store_error}")
    last = claim.last
    turn = last.turn + 1 if last is not None else earlier_turns + 1
    gap = max(now - last.ended_at, 0.0) if last is not None else None
    if not claim.acquired:
        return Lookup(CONCURRENT, turn, verdict=Verdict.CONCURRENT_TURN, gap_s=gap,
                      reason="another turn of this conversation was in flight; sent without reuse")
    handle = claim.handle
    if handle is not None:
        age = max(now - handle.stored_at, 0.0)
        if decision is None or decision.reuse is Reuse.NONE:
            why = decision.detail if decision is not None else "no reuse decision"
            return Lookup(PREFIX_MISMATCH, turn, verdict=Verdict.PREFIX_MISMATCH, entry_age_s=age, gap_s=gap,
                          reason=f"D's handle from turn {handle.turn} not injected: {why}",
                          trim_reason=decision.reason if decision is not None else TrimReason.UNVERIFIABLE)
        return Lookup(HIT, turn, handle=handle, entry_age_s=age, gap_s=gap,
                      trim_reason=decision.reason if decision.reuse is Reuse.TRIMMED else None)
    if last is not None and not last.stored and last.not_kept is not None:
        return Lookup(PREFIX_MISMATCH, turn, verdict=Verdict.PREFIX_MISMATCH, gap_s=gap,
                      reason=f"turn {last.turn}'s D handle was not kept: {last.not_kept}",
                      trim_reason=TrimReason.UNVERIFIABLE)
    if last is not None:
        age = max(now - last.ended_at, 0.0)
        if last.stored and age >= entry_ttl:
            return Lookup(EXPIRED, turn, verdict=Verdict.ROUTER_ENTRY_EXPIRED, entry_age_s=age, gap_s=gap,
                          reason=f"entry age {age:.1f}s >= router TTL {entry_ttl:g}s")
        if last.stored:
            return Lookup(LOST, turn, verdict=Verdict.ROUTER_STATE_LOST, gap_s=gap,
                          reason="the stored handle is gone before its TTL (evicted at store capacity)")
        return Lookup(MISS, turn, verdict=Verdict.METADATA_NOT_RETURNED, gap_s=gap,
                      reason=f"turn {last.turn} ended without D's kv_transfer_params "
                             f"({last.missing_reason or 'unknown'})")
    if earlier_turns > 0:
        return Lookup(LOST, turn, verdict=Verdict.ROUTER_STATE_LOST,
                      reason=f"request carries {earlier_turns} earlier replies but the store knows nothing of "
                             "the conversation (router restart, unshared replica, or record expired)")
    return Lookup(MISS, turn, verdict=Verdict.FIRST_TURN, reason="first turn of the conversation")


def prefill_verdict(*, report: PrefillReport | None, cached_tokens: int | None, failed: bool,
                    entry_age_s: float | None, decoder_ttl: float) -> tuple[Verdict, str]:
    """What P's answer means for a turn that was offered D's handle.

    An instrumented P says it in its report. A stock P only gives ``cached_tokens`` and errors, so
    the verdict is inferred (and the reason says so).
    """
    if report is not None:
        return Verdict(report.outcome), report.reason or "reported by P"
    if failed:
        if entry_age_s is not None and entry_age_s + P_EXPIRY_SAFETY_MARGIN >= decoder_ttl:
            return Verdict.EXPIRED_REMOTE_READ, (
                f"inferred: P failed the turn and the handle was {entry_age_s:.1f}s old, within "
                f"{P_EXPIRY_SAFETY_MARGIN:g}s of decoder_kv_blocks_ttl")
        return Verdict.TRANSFER_FAILED, "inferred: P failed the request it was handed D's handle with"
    if cached_tokens:
        return Verdict.REMOTE_HIT, (f"inferred: P reported {cached_tokens} cached tokens (stock P cannot tell "
                                    "local from remote hits)")
    return Verdict.UNKNOWN, ("P reported no cached tokens: bidirectional off on P, below threshold or a "
                             "declined read; instrument P to tell")


@dataclass
class TurnState:
    """Everything one turn observed; mutated by the flow, turned into an event at the end."""

    request_id: str
    endpoint: str
    started: float  # perf_counter at arrival
    ts: float = field(default_factory=now_ts)
    conversation_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    stream: bool = False
    lookup: Lookup | None = None
    verdict: Verdict = Verdict.UNKNOWN
    reason: str | None = None
    report: PrefillReport | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    ttft_ms: float | None = None
    duration_ms: float | None = None
    prefill_attempts: int = 0
    prefill_index: int | None = None
    decode_index: int | None = None
    stored: bool = False
    missing_reason: str | None = None
    failure_type: str | None = None
    status: str = "ok"
    http_status: int = 200
    error: str | None = None
    trace_id: str | None = None
    client_params_dropped: bool = False
    id_hashed: bool = False
    # partial reuse (docs/router.md "Which tokens a handle may cover")
    handle_tokens: int | None = None  # D's remote_num_tokens in the stored handle
    reuse_limit_tokens: int | None = None  # remote_num_tokens injected (0: none)
    trim_reason: TrimReason | None = None
    reuse_attrs: dict[str, Any] = field(default_factory=dict)
    not_kept: str | None = None  # why D's returned handle was not kept (request shape)
    reply_blockers: list[str] = field(default_factory=list)  # why this reply cannot be reused in full

    @property
    def trimmed_tokens(self) -> int | None:
        """Tokens of D's handle P was not allowed to read."""
        if self.handle_tokens is None or self.reuse_limit_tokens is None:
            return None
        return max(self.handle_tokens - self.reuse_limit_tokens, 0)

    @property
    def reused(self) -> bool:
        """True when the turn's history came from a cache."""
        return self.verdict in REUSED_VERDICTS

    @property
    def overhead_ms(self) -> float | None:
        """Time outside the two upstream legs."""
        if self.duration_ms is None:
            return None
        return max(self.duration_ms - (self.prefill_ms or 0.0) - (self.decode_ms or 0.0), 0.0)

    def to_event(self) -> TurnEvent:
        """The ``router_turn`` event, merged with P's report when P sent one."""
        lookup = self.lookup
        handle = lookup.handle if lookup is not None else None
        report = self.report
        attrs: dict[str, Any] = {"endpoint": self.endpoint, "stream": self.stream,
                                 "prefill_attempts": self.prefill_attempts, "stored": self.stored}
        if self.missing_reason is not None:
            attrs["missing_metadata_reason"] = self.missing_reason
        if self.error is not None:
            attrs["error"] = self.error[:500]
        if self.client_params_dropped:
            attrs["client_kv_transfer_params_dropped"] = True
        if self.id_hashed:
            attrs["id_hash"] = ID_HASH_SCHEME
        if self.prefill_index is not None:
            attrs["prefill_index"] = self.prefill_index
        if self.decode_index is not None:
            attrs["decode_index"] = self.decode_index
        if self.cached_tokens is not None:
            attrs["cached_tokens"] = self.cached_tokens
        if self.reuse_attrs:
            attrs.update(self.reuse_attrs)
        if self.not_kept is not None:
            attrs["handle_not_kept"] = self.not_kept
        if self.reply_blockers:
            attrs["reply_not_reusable"] = self.reply_blockers
        return TurnEvent(
            ts=self.ts, source="router", event="router_turn", conversation_id=self.conversation_id,
            turn=lookup.turn if lookup else None, request_id=self.request_id,
            engine_request_id=report.engine_request_id if report else None,
            engine_id=report.engine_id if report else None, tenant=self.tenant, model=self.model,
            prompt_tokens=report.prompt_tokens if report else self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            local_hit_tokens=report.local_hit_tokens if report else None,
            remote_offered_tokens=report.remote_offered_tokens if report else None,
            remote_read_tokens=report.remote_read_tokens if report else None,
            handle_tokens=self.handle_tokens, reuse_limit_tokens=self.reuse_limit_tokens,
            trimmed_tokens=self.trimmed_tokens, trim_reason=self.trim_reason.value if self.trim_reason else None,
            wrong_kv_tokens=report.wrong_kv_tokens if report else None,
            mismatch_tokens=report.mismatch_tokens if report else None,
            computed_tokens=report.computed_tokens if report else None,
            transfer_bytes=report.transfer_bytes if report else None,
            transfer_ms=report.transfer_ms if report else None,
            ttft_ms=_r(self.ttft_ms), duration_ms=_r(self.duration_ms), prefill_ms=_r(self.prefill_ms),
            decode_ms=_r(self.decode_ms), router_overhead_ms=_r(self.overhead_ms),
            lookup=lookup.result if lookup else None,
            entry_age_s=_r(lookup.entry_age_s) if lookup else None, gap_s=_r(lookup.gap_s) if lookup else None,
            remote_engine_id=_str_or_none(handle.params.get("remote_engine_id")) if handle else None,
            remote_request_id=_str_or_none(handle.params.get("remote_request_id")) if handle else None,
            outcome=self.verdict.value, reason=self.reason,
            failure_type=self.failure_type or (report.failure_type if report else None),
            status=self.status, http_status=self.http_status, trace_id=self.trace_id, attrs=attrs)


def _r(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
