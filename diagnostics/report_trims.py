"""Partial reuse in the turn table: how much of D's handles the router let P read, and why not all.

The router writes, per turn it offered a handle, D's token count (``handle_tokens``), what it let P
read (``reuse_limit_tokens``) and, when it cut the handle, ``trimmed_tokens`` and ``trim_reason``
(kvdiag.schema.verdicts.TrimReason). P's report adds ``wrong_kv_tokens`` (tokens loaded for other
ids: the sim's oracle, which must stay 0) and ``mismatch_tokens`` (offered tokens its block-hash
check refused). A pure function of the table, as every report aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import pandas as pd

from kvdiag.schema.verdicts import TRIM_INFO, TrimReason

# A reason "dominates" when it accounts for at least this share of the trimmed tokens.
DOMINANT_SHARE: Final = 0.5
# Trims a deployment cannot avoid (templates drop reasoning, a regenerate drops the reply): info, not a warning.
EXPECTED_TRIMS: Final = frozenset({TrimReason.REASONING_HIDDEN, TrimReason.REASONING_STRIPPED,
                                   TrimReason.REPLY_ABSENT})
BY_REASON_COLUMNS: Final = ("turns", "trimmed_tokens", "share_of_trimmed", "summary", "fix")


@dataclass
class TrimSummary:
    """Totals over the turns the router offered a handle, and the trimmed tokens by reason."""

    handle_turns: int
    handle_tokens: int
    reuse_limit_tokens: int
    reused_tokens: int
    trimmed_turns: int
    trimmed_tokens: int
    wrong_kv_tokens: int | None  # None: no event stated it
    mismatch_tokens: int | None
    by_reason: pd.DataFrame = field(default_factory=pd.DataFrame)
    dominant: str | None = None

    @property
    def trimmed_share(self) -> float | None:
        """Trimmed tokens over D's handle tokens (None without handles)."""
        return round(self.trimmed_tokens / self.handle_tokens, 4) if self.handle_tokens else None

    @property
    def dominant_fix(self) -> str | None:
        """TRIM_INFO's fix for the dominant reason."""
        return TRIM_INFO[TrimReason(self.dominant)].fix if self.dominant else None

    def to_json_dict(self) -> dict[str, Any]:
        """The report --json ``trims`` object."""
        rows = [{"trim_reason": str(idx), "turns": int(r["turns"]), "trimmed_tokens": int(r["trimmed_tokens"]),
                 "share_of_trimmed": float(r["share_of_trimmed"]), "summary": str(r["summary"]), "fix": str(r["fix"])}
                for idx, r in self.by_reason.iterrows()]
        return {"handle_turns": self.handle_turns, "handle_tokens": self.handle_tokens,
                "reuse_limit_tokens": self.reuse_limit_tokens, "reused_tokens": self.reused_tokens,
                "trimmed_turns": self.trimmed_turns, "trimmed_tokens": self.trimmed_tokens,
                "trimmed_share": self.trimmed_share, "wrong_kv_tokens": self.wrong_kv_tokens,
                "mismatch_tokens": self.mismatch_tokens, "dominant": self.dominant,
                "dominant_fix": self.dominant_fix, "by_reason": rows}


def _total(series: pd.Series) -> int:
    return int(series.fillna(0).sum())


def _known_total(series: pd.Series) -> int | None:
    known = series.dropna()
    return int(known.sum()) if len(known) else None


def trim_summary(df: pd.DataFrame) -> TrimSummary:
    """Summarize partial reuse over the turns whose router event states D's handle."""
    cols = df[["handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason", "remote_tokens",
               "wrong_kv_tokens", "mismatch_tokens"]]
    handled = cols[cols["handle_tokens"].notna()]
    reasons = handled["trim_reason"]
    trimmed = handled[reasons.notna() & (reasons.astype(str) != "")]
    total_trimmed = _total(handled["trimmed_tokens"])
    rows: list[dict[str, Any]] = []
    for reason, part in trimmed.groupby("trim_reason", sort=False):
        info = TRIM_INFO[TrimReason(str(reason))]
        tokens = _total(part["trimmed_tokens"])
        rows.append({"trim_reason": str(reason), "turns": len(part), "trimmed_tokens": tokens,
                     "share_of_trimmed": round(tokens / total_trimmed, 4) if total_trimmed else 0.0,
                     "summary": info.summary, "fix": info.fix})
    by_reason = (pd.DataFrame(rows, columns=["trim_reason", *BY_REASON_COLUMNS])
                 .sort_values(["trimmed_tokens", "turns", "trim_reason"], ascending=[False, False, True])
                 .set_index("trim_reason"))
    dominant = None
    if len(by_reason) and float(by_reason["share_of_trimmed"].iloc[0]) >= DOMINANT_SHARE:
        dominant = str(by_reason.index[0])
    return TrimSummary(
        handle_turns=len(handled), handle_tokens=_total(handled["handle_tokens"]),
        reuse_limit_tokens=_total(handled["reuse_limit_tokens"]), reused_tokens=_total(handled["remote_tokens"]),
        trimmed_turns=len(trimmed), trimmed_tokens=total_trimmed,
        wrong_kv_tokens=_known_total(cols["wrong_kv_tokens"]), mismatch_tokens=_known_total(cols["mismatch_tokens"]),
        by_reason=by_reason, dominant=dominant)
