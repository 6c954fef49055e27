"""Internal: hand-written inline SVG charts and the self-contained page shell for kvdiag's HTML files.

No CDN, no fonts, no network at view time: one HTML file with inline CSS, SVG and a few lines of
JS for a hover tooltip (every mark also carries an SVG ``<title>``, so hover works without JS).
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kvdiag.schema.verdicts import Verdict

# One fixed colour per verdict, so every picture and legend agrees. Reuse is green, first turns grey,
# configuration misses warm, failures red.
VERDICT_COLORS: Final[dict[str, str]] = {
    Verdict.FIRST_TURN: "#9e9e9e",
    Verdict.REMOTE_HIT: "#2e7d32",
    Verdict.LOCAL_HIT: "#81c784",
    Verdict.BELOW_THRESHOLD: "#c0ca33",
    Verdict.NO_CONVERSATION_ID: "#8d6e63",
    Verdict.METADATA_NOT_RETURNED: "#ff9800",
    Verdict.ROUTER_STATE_LOST: "#ab47bc",
    Verdict.ROUTER_ENTRY_EXPIRED: "#42a5f5",
    Verdict.EXPIRED_REMOTE_READ: "#1565c0",
    Verdict.TRANSFER_FAILED: "#e53935",
    Verdict.FEATURE_DISABLED_ON_PREFILL: "#f4511e",
    Verdict.PREFIX_MISMATCH: "#6d4c41",
    Verdict.CONCURRENT_TURN: "#00897b",
    Verdict.REQUEST_FAILED: "#b71c1c",
    Verdict.UNKNOWN: "#424242",
}

CSS: Final = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#212121;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#616161}.chart{margin:8px 0 16px}svg text{font:12px system-ui,sans-serif;fill:#333}
table{border-collapse:collapse;margin:6px 0 12px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f5f5f5}td:first-child,th:first-child{text-align:left}
.legend span{display:inline-block;margin-right:12px}.legend i{display:inline-block;width:11px;height:11px;
margin-right:4px;vertical-align:-1px}
#tip{position:fixed;pointer-events:none;background:#263238;color:#fff;padding:6px 8px;border-radius:4px;
font-size:12px;max-width:520px;white-space:pre-wrap;display:none;z-index:10}
.sev-error{color:#b71c1c;font-weight:600}.sev-warning{color:#e65100;font-weight:600}.sev-ok{color:#2e7d32}
.sev-missing_data,.sev-info{color:#546e7a}.evidence{table-layout:fixed;width:100%}
.evidence td,.evidence th{text-align:left;vertical-align:top;overflow-wrap:anywhere}.evidence code{font-size:11px}
"""

# The tooltip mirrors each mark's data-tip; guarded so a page without marks logs nothing.
JS: Final = """
(function(){var t=document.getElementById('tip');if(!t){return;}
document.addEventListener('mousemove',function(e){var el=e.target.closest?e.target.closest('[data-tip]'):null;
if(!el){t.style.display='none';return;}t.textContent=el.getAttribute('data-tip');t.style.display='block';
t.style.left=(e.clientX+14)+'px';t.style.top=(e.clientY+14)+'px';});})();
"""


def esc(text: object) -> str:
    """HTML/SVG-escape any value (quotes too: values go into attributes)."""
    return html.escape(str(text), quote=True)


def page(title: str, body: str) -> str:
    """A complete self-contained HTML document."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n{body}\n"
            f'<div id="tip"></div><script>{JS}</script></body></html>\n')


def color(verdict: str) -> str:
    """The verdict's colour (grey for anything unexpected)."""
    return VERDICT_COLORS.get(verdict, "#757575")


def legend(verdicts: Sequence[str]) -> str:
    """An HTML legend of verdict colours."""
    return legend_pairs([(v, color(v)) for v in verdicts])


def legend_pairs(pairs: Sequence[tuple[str, str]]) -> str:
    """An HTML legend of (name, colour) pairs."""
    items = "".join(f'<span><i style="background:{c}"></i>{esc(n)}</span>' for n, c in pairs)
    return f'<div class="legend">{items}</div>'


def mark_attrs(tip: str, **data: object) -> str:
    """``data-*`` attributes plus the tooltip text, for one mark."""
    attrs = "".join(f" data-{k.replace('_', '-')}=\"{esc(v)}\"" for k, v in data.items())
    return f'{attrs} data-tip="{esc(tip)}"'


def nice_ceiling(value: float) -> float:
    """Round up to 1, 2 or 5 × 10ⁿ, for axis tops."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for m in (1, 2, 5, 10):
        if value <= m * exp:
            return float(m * exp)
    return float(10 * exp)


def fmt(value: float) -> str:
    """Short number for axis labels."""
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:g}"


@dataclass(frozen=True)
class Frame:
    """Plot area geometry."""

    width: int = 720
    height: int = 260
    left: int = 56
    right: int = 16
    top: int = 14
    bottom: int = 40

    @property
    def inner_w(self) -> float:
        return float(self.width - self.left - self.right)

    @property
    def inner_h(self) -> float:
        return float(self.height - self.top - self.bottom)


def _y_axis(f: Frame, top: float, label: str, ticks: int = 4) -> str:
    out = []
    for i in range(ticks + 1):
        v = top * i / ticks
        y = f.top + f.inner_h - f.inner_h * i / ticks
        out.append(f'<line x1="{f.left}" x2="{f.width - f.right}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="#eee"/><text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    out.append(f'<text transform="translate(12,{f.top + f.inner_h / 2:.0f}) rotate(-90)" '
               f'text-anchor="middle">{esc(label)}</text>')
    return "".join(out)


def _svg(f: Frame, chart_id: str, body: str, aria: str) -> str:
    return (f'<svg id="{esc(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
            f'width="{f.width}" height="{f.height}" viewBox="0 0 {f.width} {f.height}" role="img" '
            f'aria-label="{esc(aria)}">{body}</svg>')


def stacked_share_bars(chart_id: str, categories: Sequence[str], counts: Mapping[str, Mapping[str, int]],
                       series: Sequence[str], title: str, frame: Frame = Frame()) -> str:
    """100 % stacked bars: one bar per category, one segment (``class="seg"``) per non-zero series."""
    f = frame
    band = f.inner_w / max(len(categories), 1)
    parts = [_y_axis(f, 100.0, "% of turns")]
    for i, cat in enumerate(categories):
        row = counts.get(cat, {})
        total = sum(row.get(s, 0) for s in series)
        x = f.left + i * band + band * 0.15
        w = band * 0.7
        y = f.top + f.inner_h
        for s in series:
            n = row.get(s, 0)
            if not n:
                continue
            h = f.inner_h * n / total
            y -= h
            tip = f"{title} {cat}: {s} {n} of {total} turns ({n / total:.1%})"
            parts.append(f'<rect class="seg" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                         f'fill="{color(s)}"{mark_attrs(tip, bucket=cat, verdict=s, count=n)}>'
                         f"<title>{esc(tip)}</title></rect>")
        parts.append(f'<text x="{x + w / 2:.1f}" y="{f.height - f.bottom + 16}" text-anchor="middle">'
                     f'{esc(cat)}</text><text x="{x + w / 2:.1f}" y="{f.height - f.bottom + 30}" '
                     f'text-anchor="middle" fill="#777">n={total}</text>')
    return _svg(f, chart_id, "".join(parts), title)


@dataclass(frozen=True)
class BarValue:
    """One bar of a grouped chart: a central value with an optional upper whisker."""

    value: float | None
    upper: float | None = None
    n: int = 0


def grouped_bars(chart_id: str, categories: Sequence[str], groups: Sequence[tuple[str, str]],
                 values: Mapping[str, Mapping[str, BarValue]], y_label: str, title: str,
                 frame: Frame = Frame()) -> str:
    """Side-by-side bars per category (``class="bar"``); ``groups`` are (name, colour)."""
    f = frame
    top = nice_ceiling(max([v.upper or v.value or 0.0 for row in values.values() for v in row.values()] + [1.0]))
    band = f.inner_w / max(len(categories), 1)
    w = band * 0.7 / max(len(groups), 1)
    parts = [_y_axis(f, top, y_label)]
    for i, cat in enumerate(categories):
        x0 = f.left + i * band + band * 0.15
        for j, (name, fill) in enumerate(groups):
            v = values.get(cat, {}).get(name)
            x = x0 + j * w
            if v is not None and v.value is not None:
                h = f.inner_h * v.value / top
                y = f.top + f.inner_h - h
                tip = f"{title} {cat}, {name}: p50 {v.value:.1f}" + (
                    f", p95 {v.upper:.1f}" if v.upper is not None else "") + f" (n={v.n})"
                parts.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{w * 0.92:.1f}" '
                             f'height="{h:.1f}" fill="{fill}"{mark_attrs(tip, bucket=cat, group=name, n=v.n)}>'
                             f"<title>{esc(tip)}</title></rect>")
                if v.upper is not None:
                    yu = f.top + f.inner_h - f.inner_h * v.upper / top
                    cx = x + w * 0.46
                    parts.append(f'<line class="whisker" x1="{cx:.1f}" x2="{cx:.1f}" y1="{y:.1f}" '
                                 f'y2="{yu:.1f}" stroke="#333"/><line x1="{cx - 4:.1f}" x2="{cx + 4:.1f}" '
                                 f'y1="{yu:.1f}" y2="{yu:.1f}" stroke="#333"/>')
        parts.append(f'<text x="{x0 + band * 0.35:.1f}" y="{f.height - f.bottom + 16}" text-anchor="middle">'
                     f"{esc(cat)}</text>")
    return _svg(f, chart_id, "".join(parts), title)


def histogram(chart_id: str, edges: Sequence[float], counts: Sequence[int], x_label: str, title: str,
              lines: Sequence[tuple[str, float, str]] = (), frame: Frame = Frame()) -> str:
    """Histogram bars (``class="hist-bar"``) with labelled vertical lines (``class="vline"``)."""
    f = frame
    if not counts:
        return _svg(f, chart_id, f'<text x="{f.width / 2}" y="{f.height / 2}" text-anchor="middle">'
                                 "no data</text>", title)
    top = nice_ceiling(max(counts))
    lo, hi = edges[0], edges[-1]
    span = (hi - lo) or 1.0

    def sx(v: float) -> float:
        return f.left + f.inner_w * (v - lo) / span

    parts = [_y_axis(f, top, "turns")]
    for i, n in enumerate(counts):
        x1, x2 = sx(edges[i]), sx(edges[i + 1])
        h = f.inner_h * n / top
        tip = f"{edges[i]:.1f}–{edges[i + 1]:.1f} s: {n} turns"
        parts.append(f'<rect class="hist-bar" x="{x1:.1f}" y="{f.top + f.inner_h - h:.1f}" '
                     f'width="{max(x2 - x1 - 1, 0.5):.1f}" height="{h:.1f}" fill="#78909c"'
                     f"{mark_attrs(tip, count=n)}><title>{esc(tip)}</title></rect>")
    for k in range(5):
        v = lo + span * k / 4
        parts.append(f'<text x="{sx(v):.1f}" y="{f.height - f.bottom + 16}" text-anchor="middle">'
                     f"{fmt(round(v) if v >= 100 else round(v, 1))}</text>")
    parts.append(f'<text x="{f.left + f.inner_w / 2:.0f}" y="{f.height - 6}" text-anchor="middle">'
                 f"{esc(x_label)}</text>")
    for i, (label, value, stroke) in enumerate(lines):
        x = sx(min(max(value, lo), hi))
        right = x > f.left + 0.7 * f.inner_w  # label on the left of lines near the right edge
        parts.append(f'<line class="vline" x1="{x:.1f}" x2="{x:.1f}" y1="{f.top}" y2="{f.top + f.inner_h}" '
                     f"stroke=\"{stroke}\" stroke-width=\"2\" stroke-dasharray=\"{'' if i == 0 else '5 3'}\""
                     f"{mark_attrs(f'{label}: {value:g} s', line=label)}><title>{esc(label)}: {value:g} s</title>"
                     f'</line><text x="{x + (-4 if right else 4):.1f}" y="{f.top + 12 + 14 * i}" '
                     f"text-anchor=\"{'end' if right else 'start'}\" fill=\"{stroke}\">"
                     f"{esc(label)} {value:g} s</text>")
    return _svg(f, chart_id, "".join(parts), title)


def html_table(headers: Sequence[str], rows: Sequence[Sequence[object]], table_id: str = "") -> str:
    """A plain HTML table; None cells print as an en dash."""
    def cell(v: object) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "–"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 1 else f"{v:,.1f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return esc(v)
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    ident = f' id="{esc(table_id)}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
