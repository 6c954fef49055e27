"""Partial reuse in the turn table: how much of D's handles the router let P read, and why not all.

The router writes, per turn it offered a handle, D's token count (``handle_tokens``), what it let P
read (``reuse_limit_tokens``) and, when it cut the handle, ``trimmed_tokens`` and ``trim_reason``
(kvdiag.schema.verdicts.TrimReason). P's report adds ``wrong_kv_tokens`` (tokens loaded for other
ids: the sim's oracle, which must stay 0) and ``mismatch_tokens`` (offered tokens its block-hash
check refused). A pure function of the table, as every report aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvdiag.diagnostics.report_sections import Section, SectionFrame, TurnTable
from kvdiag.schema.verdicts import TRIM_INFO, TrimReason

if TYPE_CHECKING:
    pass

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
    reasons: Section = field(default_factory=lambda: Section("trim_reason", BY_REASON_COLUMNS, ()))
    dominant: str | None = None

    by_reason = SectionFrame("reasons")  # the trimmed tokens by reason as a DataFrame (most tokens first)

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
        return {"handle_turns": self.handle_turns, "handle_tokens": self.handle_tokens,
                "reuse_limit_tokens": self.reuse_limit_tokens, "reused_tokens": self.reused_tokens,
                "trimmed_turns": self.trimmed_turns, "trimmed_tokens": self.trimmed_tokens,
                "trimmed_share": self.trimmed_share, "wrong_kv_tokens": self.wrong_kv_tokens,
                "mismatch_tokens": self.mismatch_tokens, "dominant": self.dominant,
                "dominant_fix": self.dominant_fix, "by_reason": self.reasons.records()}


def trim_summary(tt: TurnTable) -> TrimSummary:
    """Summarize partial reuse over the turns whose router event states D's handle."""
    handled = "handle_tokens IS NOT NULL"
    trimmed = f"{handled} AND trim_reason IS NOT NULL AND trim_reason <> ''"
    (turns, handle, limit, reused, n_trimmed, tokens, wrong, mismatch), = tt.rows(
        f"""SELECT count(*) FILTER (WHERE {handled}), coalesce(sum(handle_tokens), 0),
                   coalesce(sum(reuse_limit_tokens) FILTER (WHERE {handled}), 0),
                   coalesce(sum(remote_tokens) FILTER (WHERE {handled}), 0), count(*) FILTER (WHERE {trimmed}),
                   coalesce(sum(trimmed_tokens) FILTER (WHERE {handled}), 0), sum(wrong_kv_tokens),
                   sum(mismatch_tokens) FROM t""")
    total = int(tokens)
    rows = []
    for reason, n, part in tt.rows(f"SELECT trim_reason, count(*), coalesce(sum(trimmed_tokens), 0) FROM t "
                                   f"WHERE {trimmed} GROUP BY 1"):
        info = TRIM_INFO[TrimReason(str(reason))]
        rows.append((str(reason), (int(n), int(part), round(int(part) / total, 4) if total else 0.0, info.summary,
                                   info.fix)))
    rows.sort(key=lambda r: (-r[1][1], -r[1][0], r[0]))
    dominant = rows[0][0] if rows and rows[0][1][2] >= DOMINANT_SHARE else None
    return TrimSummary(
        handle_turns=int(turns), handle_tokens=int(handle), reuse_limit_tokens=int(limit), reused_tokens=int(reused),
        trimmed_turns=int(n_trimmed), trimmed_tokens=total,
        wrong_kv_tokens=None if wrong is None else int(wrong),
        mismatch_tokens=None if mismatch is None else int(mismatch),
        reasons=Section("trim_reason", BY_REASON_COLUMNS, tuple(rows)), dominant=dominant)
