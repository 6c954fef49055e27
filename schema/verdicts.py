"""The per-turn verdict names: the single source of truth.

Every emitter writes one of these as an event's ``outcome``; ``kvdiag explain`` reports them;
metrics label turns with them; docs/verdicts.md documents them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Verdict(StrEnum):
    """Why a turn did or did not reuse KV."""

    FIRST_TURN = "first_turn"
    REMOTE_HIT = "remote_hit"
    LOCAL_HIT = "local_hit"
    BELOW_THRESHOLD = "below_threshold"
    NO_CONVERSATION_ID = "no_conversation_id"
    METADATA_NOT_RETURNED = "metadata_not_returned"
    ROUTER_STATE_LOST = "router_state_lost"
    ROUTER_ENTRY_EXPIRED = "router_entry_expired"
    EXPIRED_REMOTE_READ = "expired_remote_read"
    TRANSFER_FAILED = "transfer_failed"
    FEATURE_DISABLED_ON_PREFILL = "feature_disabled_on_prefill"
    PREFIX_MISMATCH = "prefix_mismatch"
    CONCURRENT_TURN = "concurrent_turn"
    REQUEST_FAILED = "request_failed"
    UNKNOWN = "unknown"


class Confidence(StrEnum):
    """How a verdict is known: a log line proves it, or it is deduced from what is absent."""

    CONFIRMED = "confirmed"
    INFERRED = "inferred"


@dataclass(frozen=True)
class VerdictInfo:
    """Documentation and operator guidance for one verdict."""

    verdict: Verdict
    reused: bool
    eligible: bool
    summary: str
    fix: str


# ``eligible``: a later turn that could have reused D's KV had everything worked; the reuse
# ratio of eligible turns is the headline number on the dashboards.
VERDICT_INFO: dict[Verdict, VerdictInfo] = {
    info.verdict: info
    for info in (
        VerdictInfo(Verdict.FIRST_TURN, False, False,
                    "First turn of the conversation: nothing to retrieve yet.",
                    "Nothing to fix."),
        VerdictInfo(Verdict.REMOTE_HIT, True, True,
                    "P read the conversation's KV back from D over NIXL (D->P).",
                    "Nothing to fix."),
        VerdictInfo(Verdict.LOCAL_HIT, True, True,
                    "P's own prefix cache already held the history; no D->P read was needed.",
                    "Nothing to fix."),
        VerdictInfo(Verdict.BELOW_THRESHOLD, False, True,
                    "The remote remainder was below kv_recompute_threshold, so P recomputed it.",
                    "Expected for short remainders; lower kv_recompute_threshold if transfers are cheap."),
        VerdictInfo(Verdict.NO_CONVERSATION_ID, False, True,
                    "The client sent no conversation_id, so the router could not link the turns.",
                    "Send a top-level conversation_id (benchmark: --send-conversation-id)."),
        VerdictInfo(Verdict.METADATA_NOT_RETURNED, False, True,
                    "The previous turn's decode response carried no kv_transfer_params.",
                    "Apply vLLM PR #40186 for streaming, enable bidirectional_kv_xfer on D, "
                    "and check for aborted or disconnected previous turns."),
        VerdictInfo(Verdict.ROUTER_STATE_LOST, False, True,
                    "The router had stored the handle, but it was gone (restart or unshared replica).",
                    "Use a shared store (--state redis://...) so restarts and replicas keep handles."),
        VerdictInfo(Verdict.ROUTER_ENTRY_EXPIRED, False, True,
                    "The router's entry had expired before the next turn arrived.",
                    "Raise decoder_kv_blocks_ttl (and the router TTL below it) or expect recompute."),
        VerdictInfo(Verdict.EXPIRED_REMOTE_READ, False, True,
                    "The params reached P but D's blocks were released or declined as expiring.",
                    "Keep the router TTL below decoder_kv_blocks_ttl minus 5 s; raise the decode TTL."),
        VerdictInfo(Verdict.TRANSFER_FAILED, False, True,
                    "The D->P NIXL read failed for a reason other than expiry.",
                    "Check NIXL connectivity (side-channel port, engine ids, backends) between P and D."),
        VerdictInfo(Verdict.FEATURE_DISABLED_ON_PREFILL, False, True,
                    "P does not have bidirectional_kv_xfer enabled, so it ignored D's handle.",
                    "Set bidirectional_kv_xfer: true in P's kv_connector_extra_config."),
        VerdictInfo(Verdict.PREFIX_MISMATCH, False, True,
                    "The new prompt does not extend the sequence D holds (edited or stripped history).",
                    "Send the history back unchanged (keep reasoning) or accept recompute."),
        VerdictInfo(Verdict.CONCURRENT_TURN, False, True,
                    "Another turn of the same conversation was in flight; this one went without reuse.",
                    "Serialize turns of one conversation in the client."),
        VerdictInfo(Verdict.REQUEST_FAILED, False, False,
                    "The turn failed for a reason unrelated to reuse.",
                    "See the error in the evidence."),
        VerdictInfo(Verdict.UNKNOWN, False, False,
                    "The logs given cannot decide this turn.",
                    "Add the log source named in the reason."),
    )
}

REUSED_VERDICTS: frozenset[Verdict] = frozenset(v for v, i in VERDICT_INFO.items() if i.reused)
ELIGIBLE_VERDICTS: frozenset[Verdict] = frozenset(v for v, i in VERDICT_INFO.items() if i.eligible)


class TrimReason(StrEnum):
    """Why the router let P read fewer of D's tokens than D's handle covers (partial reuse)."""

    REASONING_HIDDEN = "reasoning_hidden"
    REASONING_STRIPPED = "reasoning_stripped"
    TOOL_CALL_RERENDERED = "tool_call_rerendered"
    REPLY_EDITED = "reply_edited"
    REPLY_ABSENT = "reply_absent"
    HISTORY_EDITED = "history_edited"
    HISTORY_REASONING = "history_reasoning"
    UNVERIFIABLE = "unverifiable"
    TOKEN_MISMATCH = "token_mismatch"


@dataclass(frozen=True)
class TrimInfo:
    """Documentation and operator guidance for one trim reason."""

    reason: TrimReason
    summary: str
    fix: str
    # True when a deployment that trims most of its handles for this reason has a client, template or
    # router setting worth changing (the alert KVDiagHandlesMostlyTrimmed watches these).
    fixable: bool = True


# A trimmed turn still reuses the tokens the router could prove (the previous prompt, or the last
# turn boundary before an edit); only D's tokens beyond that are recomputed by P.
TRIM_INFO: dict[TrimReason, TrimInfo] = {
    info.reason: info
    for info in (
        TrimInfo(TrimReason.REASONING_HIDDEN,
                 "The request hid the reasoning (include_reasoning: false), so the client cannot send "
                 "back the tokens D generated; reuse stops at the previous prompt.",
                 "Expected with hidden reasoning; only the reply is recomputed.", fixable=False),
        TrimInfo(TrimReason.REASONING_STRIPPED,
                 "The reply carried reasoning (reasoning_content / reasoning deltas or <think> tags), "
                 "which chat templates drop from history; reuse stops at the previous prompt.",
                 "Expected for reasoning models; only the reply is recomputed.", fixable=False),
        TrimInfo(TrimReason.TOOL_CALL_RERENDERED,
                 "The reply was a tool call, which the chat template re-renders from the structured "
                 "message (JSON spacing, key order, wrapper tokens); reuse stops at the previous prompt.",
                 "Expected for tool calls; --verify-tokens proves and reuses what is identical."),
        TrimInfo(TrimReason.REPLY_EDITED,
                 "The assistant message at the reply's position differs from what D generated.",
                 "Send the reply back unchanged to reuse it."),
        TrimInfo(TrimReason.REPLY_ABSENT,
                 "The prompt does not carry the previous reply (a regenerate or a branch from the "
                 "previous prompt); reuse stops at the previous prompt.",
                 "Nothing to fix.", fixable=False),
        TrimInfo(TrimReason.HISTORY_EDITED,
                 "An earlier message changed (edit, compaction); reuse stops at the last turn "
                 "boundary before the change.",
                 "Edit or compact history less often, or accept the recompute."),
        TrimInfo(TrimReason.HISTORY_REASONING,
                 "The history carries reasoning that the chat template may render differently once a "
                 "later user message arrives; reuse stops before it.",
                 "Do not send reasoning_content back, or use --verify-tokens."),
        TrimInfo(TrimReason.UNVERIFIABLE,
                 "The request or reply has a part whose tokens the router cannot check from text "
                 "(n > 1, stop strings, template options, refusals, an oversized stream).",
                 "Use --verify-tokens to prove token equality, or drop the option."),
        TrimInfo(TrimReason.TOKEN_MISMATCH,
                 "Token-exact verification found the prompt's tokens differing from D's sequence; "
                 "reuse stops at the first differing block.",
                 "Check the chat template and the client's history rendering."),
    )
}


FIXABLE_TRIM_REASONS: frozenset[TrimReason] = frozenset(r for r, i in TRIM_INFO.items() if i.fixable)


def parse_verdict(value: str) -> Verdict:
    """Return the Verdict named ``value``; raise ValueError listing the valid names."""
    try:
        return Verdict(value)
    except ValueError:
        valid = ", ".join(v.value for v in Verdict)
        raise ValueError(f"unknown verdict {value!r}; expected one of: {valid}") from None
