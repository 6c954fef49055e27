"""Terminal output of ``kvdiag report`` and ``kvdiag advise`` (rich renderables, no printing).

Compact by default (80 columns and up): verdicts as rows, humanized durations, sizes and shares,
cells that never wrap, and the partial-reuse fixes and the gaps as wrapped paragraphs. ``wide``
gives every column of every section under its JSON name (what ``--wide`` prints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvdiag.diagnostics.humanize import (
    MISSING,
    human_bytes,
    human_count,
    human_ms,
    human_ratio,
    human_s,
    human_share,
)
from kvdiag.diagnostics.report import Report
from kvdiag.diagnostics.report_sections import Section
from kvdiag.diagnostics.terminal import cell, compact_table

if TYPE_CHECKING:
    from kvdiag.diagnostics.advise import Advice

Fmt = Callable[[Any], str]
# (column, header, formatter) per compact section; a column absent from the frame is left out.
_TTFT: Final[tuple[tuple[str, str, Fmt], ...]] = (
    ("reused_n", "reused", human_count), ("reused_p50_ms", "p50", human_ms), ("reused_p95_ms", "p95", human_ms),
    ("recomputed_n", "recomp.", human_count), ("recomputed_p50_ms", "p50", human_ms),
    ("recomputed_p95_ms", "p95", human_ms), ("speedup_p50", "speed-up", human_ratio))
_TRANSFER: Final[tuple[tuple[str, str, Fmt], ...]] = (
    ("transfers", "reads", human_count), ("bytes_p50", "size p50", human_bytes), ("bytes_total", "total", human_bytes),
    ("ms_p50", "time p50", human_ms), ("ms_p95", "p95", human_ms))
_FIRST_LATER: Final[tuple[tuple[str, str, Fmt], ...]] = (
    ("n", "turns", human_count), ("reused_share", "reused", lambda v: human_share(v, 1)),
    ("unknown_share", "unknown", lambda v: human_share(v, 1)), ("ttft_p50_ms", "TTFT p50", human_ms),
    ("ttft_p95_ms", "p95", human_ms), ("prompt_tokens_p50", "prompt p50", human_count))
_TRIMS: Final[tuple[tuple[str, str, Fmt], ...]] = (
    ("turns", "turns", human_count), ("trimmed_tokens", "tokens", human_count),
    ("share_of_trimmed", "share", human_share))


def _value(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and v != v) else v


def _section(title: str, section: Section, index_header: str, spec: tuple[tuple[str, str, Fmt], ...],
             keep: Callable[[dict[str, Any]], bool] | None = None) -> Table:
    table = compact_table(Text(title, style="bold"))
    table.add_column(index_header, no_wrap=True)
    cols = [(c, h, f) for c, h, f in spec if c in section.columns]
    for _, header, _ in cols:
        table.add_column(header, justify="right", no_wrap=True)
    for key, row in section.items():
        if keep is not None and not keep(row):
            continue
        table.add_row(cell(str(key)), *[cell(fmt(_value(row[c]))) for c, _, fmt in cols])
    return table


def _mix(title: str, section: Section) -> Table:
    """Verdicts as rows (fifteen verdict columns do not fit a terminal, five buckets do)."""
    table = compact_table(Text(title, style="bold"))
    table.add_column("verdict", no_wrap=True)
    for bucket in section.index:
        table.add_column(str(bucket), justify="right", no_wrap=True)
    verdicts = [c for c in section.columns if c not in ("turns", "reused_share")]
    for name in ("turns", *verdicts):
        table.add_row(cell(name), *[cell(human_count(_value(v))) for v in section.column(name)])
    table.add_row(cell("reused"), *[cell(human_share(_value(v))) for v in section.column("reused_share")])
    return table


def report_renderables(rep: Report, *, wide: bool = False) -> list[RenderableType]:
    """Every section of the report, in print order."""
    later = rep.first_vs_later.row("later")
    head = f"{rep.turns:,} turns in {rep.conversations:,} conversations"
    if later is not None and _value(later["reused_share"]) is not None:
        head += f"; later turns reused: {human_share(later['reused_share'], 1)} of {human_count(later['n'])}"
        # (a stock run at INFO leaves hits undecided: 0% proven is not 0% reused)
        if _value(later.get("unknown_share")):
            head += f" ({human_share(later['unknown_share'], 1)} unknown)"
    out: list[RenderableType] = [Text(head, style="bold")]
    if wide:
        out += _wide_sections(rep)
        out.append(Text(gaps_line(rep)))
        return out
    out += [_mix("Outcome mix by turn index", rep.outcome_by_turn),
            _mix("Outcome mix by prompt length (tokens)", rep.outcome_by_prompt),
            _section("TTFT of later turns: reused vs recomputed", rep.ttft_by_prompt, "prompt", _TTFT,
                     keep=lambda r: bool(r.get("reused_n", 0) or r.get("recomputed_n", 0))),
            _section("D→P transfers by prompt length", rep.transfer_by_prompt, "prompt", _TRANSFER,
                     keep=lambda r: bool(r.get("transfers", 0))),
            _section("First turn vs later turns", rep.first_vs_later, "", _FIRST_LATER)]
    out += _trims(rep)
    out.append(Text(gaps_line(rep)))
    # a blank line between sections
    return [part for r in out for part in (r, Text(""))][:-1]


def _trims(rep: Report) -> list[RenderableType]:
    t = rep.trims
    if not t.handle_turns:
        return []
    parts: list[RenderableType] = [Text("Partial reuse: D's tokens the router let P read", style="bold"),
                                   Text(trims_line(rep))]
    if len(t.reasons):
        parts += [Text(""), _section("Trimmed tokens by reason", t.reasons, "reason", _TRIMS)]
        for reason, row in t.reasons.items():
            line = Text(f"{reason}: ", style="bold")
            line.append(str(row["fix"]))
            parts.append(line)
    return [Group(*parts)]


def trims_line(rep: Report) -> str:
    """The partial-reuse totals as one sentence."""
    t = rep.trims
    text = (f"{human_count(t.handle_turns)} turns had a handle from D ({human_count(t.handle_tokens)} tokens): the "
            f"router let P read up to {human_count(t.reuse_limit_tokens)}, P read {human_count(t.reused_tokens)}; "
            f"{human_count(t.trimmed_tokens)} tokens ({human_share(t.trimmed_share, 1)}) trimmed in "
            f"{human_count(t.trimmed_turns)} turns")
    if t.wrong_kv_tokens is not None:
        text += f"; wrongly loaded KV: {human_count(t.wrong_kv_tokens)} tokens"
    if t.mismatch_tokens:
        text += f"; P's block-hash check refused {human_count(t.mismatch_tokens)}"
    if t.dominant:
        text += f". Mostly {t.dominant}: {t.dominant_fix}"
    return text


def gaps_line(rep: Report) -> str:
    """The inter-turn gaps against the decode TTL as one sentence."""
    g = rep.gaps
    ttl = human_s(g.decoder_ttl_s) if g.decoder_ttl_s is not None else "unknown (pass --decoder-ttl)"
    return (f"Inter-turn gaps: {human_count(g.gaps_known)} known, p50 {human_s(g.quantiles_s['p50'])}, p95 "
            f"{human_s(g.quantiles_s['p95'])}; decode TTL {ttl}; share at or past the TTL "
            f"{human_share(g.share_over_ttl, 1)}; expired ratio {human_share(g.expired_ratio, 1)}; "
            f"missing-metadata ratio {human_share(g.missing_metadata_ratio, 1)}")


# ------------------------------------------------------------------------------------------- --wide

def _wide_sections(rep: Report) -> list[RenderableType]:
    out: list[RenderableType] = []
    for title, section in rep.sections:
        if section is rep.outcome_by_turn or section is rep.outcome_by_prompt:
            section = _transposed(section, "verdict")
        if section is rep.trims.reasons and not len(section):
            continue
        out.append(_wide_table(title, section))
    if rep.trims.handle_turns:
        out.append(Text(trims_line(rep)))
    return out


def _transposed(section: Section, index_name: str) -> Section:
    """Columns as rows (a mix table's verdicts down the side, its buckets across)."""
    rows = tuple((c, tuple(section.column(c))) for c in section.columns)
    return Section(index_name, tuple(str(k) for k in section.index), rows)


def _wide_table(title: str, section: Section) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(section.index_name)
    for c in section.columns:
        table.add_column(str(c), justify="right")
    for key, values in section.rows:
        table.add_row(Text(str(key)), *[Text(wide_cell(v)) for v in values])
    return table


def wide_cell(v: object) -> str:
    """A raw table value as the full view prints it (numbers unabbreviated)."""
    if _value(v) is None:
        return MISSING
    if isinstance(v, float):
        if v.is_integer():  # counts that passed through a float column (a transposed mix table)
            return f"{int(v):,}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:,.1f}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


_SEVERITY_STYLES: Final = {"ok": "green", "warning": "yellow", "error": "red", "missing_data": "dim", "info": "cyan"}


def advice_renderables(adv: Advice) -> list[RenderableType]:
    """``kvdiag advise``: the two recommendations as paragraphs, then the checks as a table whose finding
    column wraps within itself (a check's fix on a line of its own), so that the severities and ids stay a
    column at any width."""
    checks = compact_table(Text("Configuration checks", style="bold"))
    checks.add_column("severity", no_wrap=True)
    checks.add_column("check", no_wrap=True)
    checks.add_column("finding", overflow="fold")  # (a quoted path or log line folds instead of overflowing)
    for c in adv.checks:
        # Text, not markup: messages quote log lines and config keys ("[...]")
        finding = Text(c.message)
        if c.fix and c.severity != "ok":
            finding.append("\nfix: ", style="bold").append(c.fix)
        checks.add_row(cell(c.severity, _SEVERITY_STYLES.get(c.severity)), cell(c.id), finding)
    return [Text("Decode TTL", style="bold"), Text(adv.ttl.summary), Text(""),
            Text("kv_recompute_threshold", style="bold"), Text(adv.threshold.summary), Text(""), checks]
