"""`kvdiag explain --html`: one conversation as the article's sequence diagram, drawn from real data.

Four swimlanes (client, router, prefill, decode); each turn is a segment coloured by its verdict,
with the D→P read (history back from D) and the P→D read (the new KV to D) as arrows. Gaps between
turns are drawn as breaks labelled with their length, so a 5-minute pause does not squash the turns.
Hovering a turn shows its verdict, reason, fix and evidence lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

from kvdiag.diagnostics import html_svg as svg
from kvdiag.diagnostics.records import ConversationRecord, TurnRecord
from kvdiag.schema.verdicts import VERDICT_INFO, Verdict

LANES: Final = ("client", "router", "prefill", "decode")
LABEL_W: Final = 80
SEG_W: Final = 230
GAP_W: Final = 70
LANE_H: Final = 56
TOP: Final = 44
EVIDENCE_IN_TIP: Final = 8
# Verdicts for which P attempted (or was asked to attempt) a D->P read.
_READ_ATTEMPTED: Final = frozenset({Verdict.REMOTE_HIT, Verdict.EXPIRED_REMOTE_READ, Verdict.TRANSFER_FAILED})


def _lane_y(lane: str) -> float:
    return TOP + LANES.index(lane) * LANE_H + LANE_H / 2


def _tip(t: TurnRecord) -> str:
    lines = [f"turn {t.turn}: {t.verdict} ({t.confidence})", t.reason or VERDICT_INFO[Verdict(t.verdict)].summary]
    if t.fix:
        lines.append(f"fix: {t.fix}")
    nums = [(k, getattr(t, k)) for k in ("prompt_tokens", "remote_tokens", "computed_tokens", "transfer_bytes",
                                        "transfer_ms", "prefill_ms", "ttft_ms", "latency_ms", "gap_s", "status")]
    lines.append(", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in nums if v is not None))
    for ev in t.evidence[:EVIDENCE_IN_TIP]:
        lines.append(f"{ev.source}: {ev.text}")
    if len(t.evidence) > EVIDENCE_IN_TIP:
        lines.append(f"... {len(t.evidence) - EVIDENCE_IN_TIP} more evidence lines below")
    return "\n".join(lines)


def _turn_svg(t: TurnRecord, x0: float) -> str:
    verdict = Verdict(t.verdict)
    fill = svg.color(verdict)
    # Time inside the segment: the turn's own scale (its latency), with nominal shares when unknown.
    total = t.latency_ms or t.ttft_ms or t.prefill_ms or 1000.0
    total = max(total, (t.prefill_ms or 0.0) * 1.15, (t.ttft_ms or 0.0) * 1.05, 1e-3)
    p_start = total * 0.01
    read_ms = t.transfer_ms if t.transfer_ms else (total * 0.05 if verdict in _READ_ATTEMPTED else 0.0)
    # The P leg includes the read; when the logs' clocks disagree (a sim's scaled sleeps against its
    # modelled transfer time) the read still has to fit inside the leg.
    p_leg = t.prefill_ms if t.prefill_ms else max(total * 0.2, read_ms + total * 0.1)
    p_end = p_start + max(p_leg, read_ms * 1.25)
    ttft = t.ttft_ms if t.ttft_ms is not None else min(p_end + total * 0.05, total)
    # Piecewise time axis: up to the first token gets 60 % of the segment, the decode tail the rest,
    # so the prefill leg and the transfers stay legible next to a long reply.
    head = max(ttft, p_end * 1.02, 1e-3)
    inner = SEG_W - 20
    unit = 0.6 * inner / head

    def x(ms: float) -> float:
        if ms <= head:
            return x0 + 10 + ms * unit
        return x0 + 10 + 0.6 * inner + (ms - head) / max(total - head, 1e-3) * 0.4 * inner
    p_failed = t.status in ("error", "hung", "timeout") and verdict in _READ_ATTEMPTED
    yc, yr, yp, yd = (_lane_y(lane) for lane in LANES)
    bar = 18
    parts = [f'<g class="turn"{svg.mark_attrs(_tip(t), turn=t.turn, verdict=verdict.value)}>'
             f"<title>{svg.esc(_tip(t))}</title>",
             f'<text x="{x0 + 10}" y="{TOP - 22}" font-weight="600">turn {t.turn}</text>'
             f'<text x="{x0 + 10}" y="{TOP - 8}" fill="{fill}">{svg.esc(verdict.value)}</text>',
             f'<rect class="client-bar" x="{x(0):.1f}" y="{yc - bar / 2}" width="{x(total) - x(0):.1f}" '
             f'height="{bar}" fill="{fill}" opacity="0.85"/>',
             f'<line class="ttft" x1="{x(ttft):.1f}" x2="{x(ttft):.1f}" y1="{yc - bar}" y2="{yc + bar}" '
             f'stroke="#000" stroke-width="2"/>',
             f'<rect class="router-bar" x="{x(0):.1f}" y="{yr - 3}" width="{x(total) - x(0):.1f}" height="6" '
             f'fill="#b0bec5"/>',
             f'<line class="req" x1="{x(0):.1f}" x2="{x(p_start):.1f}" y1="{yr}" y2="{yp - bar / 2}" '
             f'stroke="#90a4ae" marker-end="url(#arrow-grey)"/>']
    if read_ms:
        ok = verdict is Verdict.REMOTE_HIT
        stroke = "#1b5e20" if ok else "#c62828"
        label = f"D→P {t.transfer_bytes / 1e6:.1f} MB, {read_ms:.0f} ms" if ok and t.transfer_bytes else (
            "D→P read" if ok else f"D→P {verdict.value}")
        parts.append(f"<line class=\"xfer d2p{' failed' if not ok else ''}\" x1=\"{x(p_start):.1f}\" "
                     f'y1="{yd - bar / 2}" x2="{x(p_start + read_ms):.1f}" y2="{yp + bar / 2}" '
                     f"stroke=\"{stroke}\" stroke-width=\"2.5\" stroke-dasharray=\"{'' if ok else '5 3'}\" "
                     f"marker-end=\"url(#arrow-{'green' if ok else 'red'})\"/>"
                     f'<text x="{x(p_start + read_ms) + 6:.1f}" y="{(yp + yd) / 2 + 4:.1f}" font-size="10" '
                     f'fill="{stroke}">'
                     f"{svg.esc(label)}</text>")
    parts.append(f'<rect class="prefill-bar" x="{x(p_start + read_ms):.1f}" y="{yp - bar / 2}" '
                 f'width="{max(x(p_end) - x(p_start + read_ms), 2):.1f}" height="{bar}" fill="{fill}"/>')
    if not p_failed:
        d_start = min(p_end + (ttft - p_end) * 0.3, total)
        parts.append(f'<line class="xfer p2d" x1="{x(p_end):.1f}" y1="{yp + bar / 2}" x2="{x(d_start):.1f}" '
                     f'y2="{yd - bar / 2}" stroke="#1565c0" stroke-width="2" marker-end="url(#arrow-blue)"/>'
                     f'<rect class="decode-bar" x="{x(d_start):.1f}" y="{yd - bar / 2}" '
                     f'width="{max(x(total) - x(d_start), 2):.1f}" height="{bar}" fill="#5c6bc0"/>')
    else:
        parts.append(f'<text x="{x(p_end):.1f}" y="{yp + 4}" fill="#b71c1c" font-weight="700">✕ {svg.esc(t.status)}'
                     "</text>")
    parts.append("</g>")
    return "".join(parts)


def _defs() -> str:
    marks = (("grey", "#90a4ae"), ("green", "#1b5e20"), ("red", "#c62828"), ("blue", "#1565c0"))
    return "<defs>" + "".join(
        f'<marker id="arrow-{n}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>' for n, c in marks
    ) + "</defs>"


def conversation_svg(conv: ConversationRecord, decoder_ttl: float | None = None) -> str:
    """The swimlane SVG of one conversation."""
    turns = sorted(conv.turns, key=lambda t: t.turn)
    width = LABEL_W + max(len(turns), 1) * (SEG_W + GAP_W)
    height = TOP + len(LANES) * LANE_H + 10
    parts = [_defs()]
    for lane in LANES:
        y = _lane_y(lane)
        parts.append(f'<line x1="{LABEL_W}" x2="{width}" y1="{y}" y2="{y}" stroke="#e0e0e0"/>'
                     f'<text class="lane" x="6" y="{y + 4}" font-weight="600">{lane}</text>')
    for i, t in enumerate(turns):
        x0 = LABEL_W + i * (SEG_W + GAP_W)
        parts.append(_turn_svg(t, x0))
        if i + 1 < len(turns):
            nxt = turns[i + 1]
            gx = x0 + SEG_W
            gap = nxt.gap_s
            if gap is None and nxt.start_ts is not None and t.end_ts is not None:
                gap = max(0.0, nxt.start_ts - t.end_ts)
            expired = decoder_ttl is not None and gap is not None and gap >= decoder_ttl
            label = f"{gap:.0f} s" if gap is not None and gap >= 10 else f"{gap:.1f} s" if gap is not None else "gap ?"
            yd = _lane_y("decode")
            tip = f"gap before turn {nxt.turn}: {label}" + (f" (≥ decode TTL {decoder_ttl:g} s)" if expired else "")
            parts.append(f"<g class=\"gap\"{svg.mark_attrs(tip, gap_s='' if gap is None else round(gap, 3))}>"
                         f"<title>{svg.esc(tip)}</title>"
                         f'<rect class="retained" x="{gx:.1f}" y="{yd - 6}" width="{GAP_W:.1f}" height="12" '
                         f"fill=\"{'#ef9a9a' if expired else '#c5cae9'}\"/>"
                         f"<text x=\"{gx + GAP_W / 2:.1f}\" y=\"{_lane_y('client') + 4}\" text-anchor=\"middle\" "
                         f'fill="#555">⋯ {svg.esc(label)} ⋯</text>'
                         f'<text x="{gx + GAP_W / 2:.1f}" y="{yd + 22}" text-anchor="middle" fill="#777" '
                         f"font-size=\"10\">{'expired' if expired else 'D holds KV'}</text></g>")
    return (f'<svg class="timeline" data-conversation="{svg.esc(conv.conversation_id)}" '
            f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="conversation timeline">'
            + "".join(parts) + "</svg>")


def _evidence_table(conv: ConversationRecord) -> str:
    rows = []
    for t in sorted(conv.turns, key=lambda r: r.turn):
        ev = "<br>".join(f"<code>{svg.esc(e.source)}</code> {svg.esc(e.text)}" for e in t.evidence) or "–"
        rows.append(f'<tr class="turn-row" data-turn="{t.turn}"><td>{t.turn}</td>'
                    f'<td style="color:{svg.color(t.verdict)}">{svg.esc(t.verdict)}</td>'
                    f'<td>{svg.esc(t.confidence)}</td>'
                    f'<td style="text-align:left">{svg.esc(t.reason)}</td><td style="text-align:left">{ev}</td></tr>')
    return ('<table class="evidence"><colgroup><col style="width:4em"><col style="width:13em"><col style="width:7em">'
            '<col style="width:22%"><col></colgroup>'
            '<thead><tr><th>turn</th><th>verdict</th><th>confidence</th><th>reason</th>'
            f"<th>evidence</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def render_conversations_html(conversations: Sequence[ConversationRecord], path: str | Path, *,
                              decoder_ttl: float | None = None, title: str | None = None) -> Path:
    """Write one self-contained HTML file with a timeline (and evidence table) per conversation."""
    body = [f"<h1>{svg.esc(title or 'kvdiag explain')}</h1>",
            svg.legend(sorted({t.verdict.value if isinstance(t.verdict, Verdict) else str(t.verdict)
                               for c in conversations for t in c.turns})),
            '<p class="meta">Arrows: green D→P read of the history (dashed red when declined or failed), '
            "blue P→D read of the new KV. Black tick: first token. Hover a turn for its evidence.</p>"]
    for conv in conversations:
        missing = f" · missing sources: {', '.join(conv.missing_sources)}" if conv.missing_sources else ""
        body.append(f"<h2>conversation {svg.esc(conv.conversation_id)}</h2>"
                    f'<p class="meta">{len(conv.turns)} turns{svg.esc(missing)}</p>'
                    f'<div style="overflow-x:auto">{conversation_svg(conv, decoder_ttl)}</div>{_evidence_table(conv)}')
    out = Path(path)
    out.write_text(svg.page(title or "kvdiag explain", "\n".join(body)), encoding="utf-8")
    return out


def render_conversation_html(conv: ConversationRecord, path: str | Path, *, decoder_ttl: float | None = None) -> Path:
    """Write one conversation's timeline as a self-contained HTML file (``kvdiag explain --html``)."""
    return render_conversations_html([conv], path, decoder_ttl=decoder_ttl,
                                     title=f"kvdiag explain: conversation {conv.conversation_id}")
