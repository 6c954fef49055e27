"""The self-contained HTML report: outcome mix, TTFT reused vs recomputed, gaps against the TTL."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvdiag.diagnostics import html_svg as svg
from kvdiag.diagnostics.advise import Advice
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report import Report, TurnData, as_frame, build_report, build_turn_table
from kvdiag.diagnostics.report_sections import Section, gap_histogram
from kvdiag.schema.metrics import PROMPT_BUCKETS, TURN_BUCKETS

REUSED_COLOR = "#2e7d32"
RECOMPUTED_COLOR = "#e53935"


def _verdicts(mix: Section) -> list[str]:
    return [c for c in mix.columns if c not in ("turns", "reused_share")]


def _mix_counts(mix: Section) -> dict[str, dict[str, int]]:
    return {str(b): {v: int(row[v]) for v in _verdicts(mix)} for b, row in mix.items()}


def _rows(section: Section) -> list[list[Any]]:
    return [[key, *values] for key, values in section.rows]


def _ttft_chart(report: Report) -> str:
    values: dict[str, dict[str, svg.BarValue]] = {}
    for b in PROMPT_BUCKETS:
        r = report.ttft_by_prompt.row(b) or {}
        values[b] = {g: svg.BarValue(r.get(f"{g}_p50_ms"), r.get(f"{g}_p95_ms"), int(r.get(f"{g}_n") or 0))
                     for g in ("reused", "recomputed")}
    return svg.grouped_bars("ttft-chart", PROMPT_BUCKETS, (("reused", REUSED_COLOR), ("recomputed", RECOMPUTED_COLOR)),
                            values, "TTFT ms (bar p50, whisker p95)", "TTFT")


def _gap_chart(report: Report, advice: Advice | None) -> str:
    g = report.gaps
    lines: list[tuple[str, float, str]] = []
    if g.decoder_ttl_s is not None:
        lines.append(("decode TTL", float(g.decoder_ttl_s), "#d32f2f"))
    if advice is not None:
        for key, stroke in (("p90", "#6a1b9a"), ("p95", "#283593"), ("p99", "#00695c")):
            v = advice.ttl.recommended_s.get(key)
            if v is not None:
                lines.append((f"TTL for {key}", float(v), stroke))
    # Bins span to the furthest line so every recommended TTL is on the picture.
    top = max([ln[1] * 1.05 for ln in lines] + [0.0])
    edges, counts = g.histogram_edges_s, g.histogram_counts
    if edges and top > edges[-1]:
        df = as_frame(report.table)
        edges, counts = gap_histogram(df.loc[df["turn"] > 1, "gap_s"].dropna().tolist(), top)
    return svg.histogram("gap-chart", edges, counts, "gap between turns (s)", "Inter-turn gaps", lines)


def _advice_html(advice: Advice) -> str:
    parts = ["<h2>Advice</h2>", f'<p id="ttl-advice">{svg.esc(advice.ttl.summary)}</p>']
    t = advice.ttl
    if t.current_s is not None and t.share_after_expiry is not None:
        rows: list[list[Any]] = [["current", t.current_s, t.share_after_expiry, t.mean_retained_gib["current"],
                                  t.retained_gib_seconds["current"]]]
        rows += [[k, t.recommended_s[k], t.share_after_expiry_at[k], t.mean_retained_gib[k],
                  t.retained_gib_seconds[k]] for k in ("p90", "p95", "p99")]
        parts.append(svg.html_table(["TTL", "seconds", "share after expiry", "mean GiB held", "GiB·s"], rows,
                                    "ttl-table"))
    parts.append(f'<p id="threshold-advice">{svg.esc(advice.threshold.summary)}</p>')
    parts.append('<ul id="checks">' + "".join(
        f'<li class="sev-{svg.esc(c.severity)}">[{svg.esc(c.severity)}] {svg.esc(c.message)}'
        + (f" <em>Fix: {svg.esc(c.fix)}</em>" if c.fix and c.severity != "ok" else "") + "</li>"
        for c in advice.checks) + "</ul>")
    return "".join(parts)


def _trims_html(report: Report) -> list[str]:
    t = report.trims
    if not t.handle_turns:
        return []
    rows: list[list[Any]] = [[t.handle_turns, t.handle_tokens, t.reuse_limit_tokens, t.reused_tokens, t.trimmed_turns,
                              t.trimmed_tokens, t.wrong_kv_tokens, t.mismatch_tokens]]
    parts = ["<h2>Partial reuse: D's tokens the router let P read, and why not all</h2>",
             svg.html_table(["turns with a handle", "D's tokens", "allowed", "reused", "trimmed turns",
                             "trimmed tokens", "wrong KV tokens", "mismatch tokens"], rows, "trim-totals-table")]
    if len(t.reasons):
        parts.append(svg.html_table(["trim reason", *t.reasons.columns], _rows(t.reasons), "trim-table"))
    return parts


def render_report_html(report: Report, advice: Advice | None = None, title: str = "kvdiag report",
                       sections: Sequence[str] = ()) -> str:
    """The report as one self-contained HTML document; ``sections`` (markup) follow the summary line."""
    seen = _verdicts(report.outcome_by_turn)
    g = report.gaps
    later = report.first_vs_later.row("later") or {}
    meta = (f"{report.turns:,} turns in {report.conversations:,} conversations · "
            f"later turns reused: {later.get('reused_share') or 0:.1%}")
    if later.get("unknown_share"):
        meta += f" ({later['unknown_share']:.1%} unknown)"
    if g.share_over_ttl is not None:
        meta += f" · later turns after the decode TTL: {g.share_over_ttl:.1%}"
    body = [
        f'<h1>{svg.esc(title)}</h1><p class="meta" id="summary" data-turns="{report.turns}">{svg.esc(meta)}</p>',
        *sections,
        "<h2>Outcome mix by turn index</h2>", svg.legend(seen),
        svg.stacked_share_bars("mix-turn-chart", TURN_BUCKETS, _mix_counts(report.outcome_by_turn), seen, "turn"),
        "<h2>Outcome mix by prompt length (tokens)</h2>",
        svg.stacked_share_bars("mix-prompt-chart", PROMPT_BUCKETS, _mix_counts(report.outcome_by_prompt), seen,
                               "prompt"),
        "<h2>TTFT of later turns: reused vs recomputed</h2>",
        svg.legend_pairs([("reused", REUSED_COLOR), ("recomputed", RECOMPUTED_COLOR)]),
        _ttft_chart(report),
        svg.html_table(["prompt", *report.ttft_by_prompt.columns], _rows(report.ttft_by_prompt), "ttft-table"),
        "<h2>Inter-turn gaps against the decode TTL</h2>", _gap_chart(report, advice),
        svg.html_table(["later turns", "gaps known", "p50 s", "p90 s", "p95 s", "p99 s", "share ≥ TTL",
                        "expired ratio", "missing-metadata ratio"],
                       [[g.later_turns, g.gaps_known, g.quantiles_s["p50"], g.quantiles_s["p90"], g.quantiles_s["p95"],
                         g.quantiles_s["p99"], g.share_over_ttl, g.expired_ratio, g.missing_metadata_ratio]],
                       "gap-table"),
        "<h2>D→P transfers by prompt length</h2>",
        svg.html_table(["prompt", *report.transfer_by_prompt.columns], _rows(report.transfer_by_prompt),
                       "transfer-table"),
        "<h2>First turn vs later turns</h2>",
        svg.html_table(["turns", *report.first_vs_later.columns], _rows(report.first_vs_later), "first-later-table"),
        *_trims_html(report),
    ]
    if advice is not None:
        body.append(_advice_html(advice))
    return svg.page(title, "\n".join(body))


def write_html_report(conversations: Sequence[ConversationRecord] | TurnData, path: str | Path, *,
                      decoder_ttl: float | None = None, advice: Advice | None = None,
                      title: str = "kvdiag report", sections: Sequence[str] = ()) -> Path:
    """Build the report from conversations (or a turn table) and write it as HTML; return the path.

    ``decoder_ttl`` draws the TTL line; ``advice`` (from :func:`kvdiag.diagnostics.advise.advise`) adds the
    recommended TTLs to the gap plot and the advice section; ``sections`` (self-contained markup)
    come right after the summary line. The demo calls this at the end of its run.
    """
    table = build_turn_table(conversations) if isinstance(conversations, Sequence) else conversations
    if decoder_ttl is None and advice is not None:
        decoder_ttl = advice.ttl.current_s
    report = build_report(table, decoder_ttl)
    out = Path(path)
    out.write_text(render_report_html(report, advice, title, sections), encoding="utf-8")
    return out
