"""Per-turn records: what the correlator and classifier produce and explain/report/advise consume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

from kvdiag.schema.verdicts import VERDICT_INFO, Confidence, Verdict


@dataclass(frozen=True)
class Evidence:
    """One log line (or event) that supports a verdict: where it is and what it says."""

    source: str  # "file:line"
    text: str


@dataclass
class TurnRecord:
    """One turn of one conversation, joined across client, router, prefill and decode logs."""

    conversation_id: str
    turn: int
    request_id: str | None = None
    start_ts: float | None = None
    end_ts: float | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    local_hit_tokens: int | None = None
    remote_offered_tokens: int | None = None
    remote_tokens: int | None = None
    computed_tokens: int | None = None
    transfer_bytes: int | None = None
    transfer_ms: float | None = None
    prefill_ms: float | None = None
    gap_s: float | None = None
    entry_age_s: float | None = None
    status: str | None = None
    failure_type: str | None = None
    prefill_request_id: str | None = None
    decode_request_id: str | None = None
    model: str | None = None
    # partial reuse (router): D's handle, what the router let P read of it, and why not all of it
    handle_tokens: int | None = None
    reuse_limit_tokens: int | None = None
    trimmed_tokens: int | None = None
    trim_reason: str | None = None
    # P's view: tokens loaded whose KV was computed for other ids (the sim's oracle), and offered
    # tokens its block-hash check refused
    wrong_kv_tokens: int | None = None
    mismatch_tokens: int | None = None
    verdict: Verdict = Verdict.UNKNOWN
    confidence: Confidence = Confidence.INFERRED
    reason: str = ""
    fix: str = ""
    evidence: list[Evidence] = field(default_factory=list)

    @property
    def reused(self) -> bool:
        """True when the turn's history came from a cache (remote or local) rather than recompute."""
        return self.verdict in (Verdict.REMOTE_HIT, Verdict.LOCAL_HIT)

    def to_json_dict(self) -> dict[str, Any]:
        """The explain --json shape of one turn."""
        return {
            "turn": self.turn,
            "request_id": self.request_id,
            "verdict": self.verdict.value,
            "confidence": self.confidence.value,
            "reason": self.reason,
            "fix": self.fix,
            "evidence": [asdict(e) for e in self.evidence],
            "start_ts": self.start_ts,
            "ttft_ms": self.ttft_ms,
            "prompt_tokens": self.prompt_tokens,
            "local_hit_tokens": self.local_hit_tokens,
            "remote_tokens": self.remote_tokens,
            "transfer_bytes": self.transfer_bytes,
            "transfer_ms": self.transfer_ms,
            "gap_s": self.gap_s,
            "status": self.status,
            "handle_tokens": self.handle_tokens,
            "reuse_limit_tokens": self.reuse_limit_tokens,
            "trimmed_tokens": self.trimmed_tokens,
            "trim_reason": self.trim_reason,
            "wrong_kv_tokens": self.wrong_kv_tokens,
            "mismatch_tokens": self.mismatch_tokens,
        }


@dataclass
class ConversationRecord:
    """All turns of one conversation, in order, and the log sources that were missing."""

    conversation_id: str
    turns: list[TurnRecord] = field(default_factory=list)
    missing_sources: list[str] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        """The explain --json document for this conversation."""
        return {
            "conversation_id": self.conversation_id,
            "turns": [t.to_json_dict() for t in self.turns],
            "missing_sources": list(self.missing_sources),
        }

    def summary(self) -> ConversationSummary:
        """What explain --all lists of it."""
        return ConversationSummary(self.conversation_id, tuple(t.turn for t in self.turns),
                                   tuple(t.verdict for t in self.turns))


@dataclass(frozen=True)
class ConversationSummary:
    """One conversation as explain --all lists it: its turns' numbers and verdicts, in order."""

    conversation_id: str
    turns: tuple[int, ...]
    verdicts: tuple[Verdict, ...]

    @property
    def severity(self) -> tuple[int, int, str]:
        """Sort key, worst first: more turns that could have reused KV and did not, then more undecided turns."""
        verdicts = self.verdicts
        return (-sum(map(_MISSED.__contains__, verdicts)), -verdicts.count(Verdict.UNKNOWN), self.conversation_id)


# the verdicts of turns that could have reused KV and did not
_MISSED: Final = frozenset(v for v, info in VERDICT_INFO.items() if info.eligible and not info.reused)
