"""Internal: each turn's fix: the verdict's own (``VERDICT_INFO``), sharpened when the numbers are known."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvdiag.diagnostics.records import TurnRecord
from kvdiag.schema.verdicts import Verdict

DEFAULT_DECODE_TTL_S: Final = 480


@dataclass(frozen=True)
class FixContext:
    """The run's settings a fix names: D's decode TTL and the router's entry TTL (None: not in the logs)."""

    decode_ttl_s: float | None = None
    router_ttl_s: float | None = None


# A fix per missing-metadata cause named in the reason (first match wins: a failed turn may say "aborted").
_METADATA_FIXES: Final = (
    ("not_streamed", "Run vLLM with PR #40186 (streamed responses then return kv_transfer_params) or send "
                     "non-streamed requests."),
    ("bidirectional_off_on_decode", "Set bidirectional_kv_xfer: true in D's kv_connector_extra_config; restart D."),
    ("decode_failed", "Fix the previous turn's failure (see its reason): a failed turn stores no handle."),
    ("prefill_failed", "Fix the previous turn's failure (see its reason): a failed turn stores no handle."),
    ("client_disconnected", "The client left before the previous reply ended, so D's handle never reached the "
                            "router: nothing to tune unless disconnects are common."),
    ("aborted", "The previous turn was aborted (client cancel or timeout): nothing to tune unless aborts are common."),
)


def fix_hint(rec: TurnRecord, ctx: FixContext) -> None:
    """Sharpen ``rec.fix`` in place from its reason and numbers."""
    if rec.verdict is Verdict.METADATA_NOT_RETURNED:
        rec.fix = next((fix for token, fix in _METADATA_FIXES if token in rec.reason), rec.fix)
    elif rec.verdict is Verdict.UNKNOWN and "VLLM_LOGGING_LEVEL=DEBUG" in rec.reason:
        rec.fix = ("Run P with VLLM_LOGGING_LEVEL=DEBUG, or load kvdiag's connector on P (docs/connector.md) for "
                   "prefill events.")
    elif rec.verdict is Verdict.EXPIRED_REMOTE_READ and rec.gap_s is not None:
        ttl = ctx.decode_ttl_s or DEFAULT_DECODE_TTL_S
        assumed = "" if ctx.decode_ttl_s else " (vLLM's default; D's startup line was not in the logs)"
        if rec.gap_s >= ttl - 5:
            rec.fix = (f"gap {rec.gap_s:.0f} s vs decoder_kv_blocks_ttl {ttl:.0f} s{assumed} (P declines within 5 s "
                       "of expiry): raise the TTL or expect recompute")
        else:  # the gap does not explain it: a shorter real TTL, or P's clock ahead of D's
            real_ttl = "D's real TTL (its 'Bidirectional KV transfer is enabled' line) and " if assumed else ""
            rec.fix = (f"gap {rec.gap_s:.0f} s is well inside decoder_kv_blocks_ttl {ttl:.0f} s{assumed}: check "
                       f"{real_ttl}the clock sync (NTP) of P and D: P judges D's expiry time by its own clock")
    elif rec.verdict is Verdict.ROUTER_ENTRY_EXPIRED and rec.entry_age_s is not None and ctx.router_ttl_s:
        rec.fix = (f"entry age {rec.entry_age_s:.1f} s > router TTL {ctx.router_ttl_s:g} s: raise the router TTL "
                   "(keep it below decoder_kv_blocks_ttl − 5 s) or expect recompute")
