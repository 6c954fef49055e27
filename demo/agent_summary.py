"""The demo's agent views: reuse per agent scenario (reused, trimmed and why, wrongly loaded) and the article's effect.

Everything comes from the run's logs: the agent router's events (P's report merged: tokens read,
trimmed tokens and the trim reason, wrongly loaded tokens), the client log (which scenario a
request belongs to, client-side TTFT) and the agent engines' events (token counts per leg).

The article view compares, turn by turn, the two long conversations (one reusing D's KV, one
recomputed) by their **modelled** TTFT: the calibrated time model applied to the token counts
each engine reported (P: the D->P read and the prefill of what it computed; D: the P->D read,
the prefill of the last token and the first decode step), exactly what the engines slept before
scaling. It does not depend on how loaded the machine is; the client-side TTFT divided by the
time scale is shown beside it.

Usage::

    agents = summarize_agents(out_dir)
    agents.render(console)
    sections = agents.html_sections()
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from rich.console import Console
from rich.table import Table

from kvdiag.demo.agent_phases import (
    AGENT_PROFILE,
    AGENT_TIME_SCALE,
    ARTICLE_RECOMPUTE_ID,
    ARTICLE_REUSE_ID,
    ARTICLE_ROWS,
    agent_scenarios,
)
from kvdiag.diagnostics import html_svg as svg
from kvdiag.schema.events import ReadStats, TurnEvent, read_events
from kvdiag.sim.timemodel import Profile, get_profile

AGENT_FILES: Final = ("agent-prefill.log", "agent-decode.log", "agent-prefill-events.jsonl",
                      "agent-decode-events.jsonl", "agent-router-events.jsonl", "agent-proxy.log")
ARTICLE_TOLERANCE: Final = 0.15
_REUSED_COLOR: Final = "#2e7d32"
_RECOMPUTED_COLOR: Final = "#e53935"


@dataclass
class ScenarioRow:
    """One agent scenario's turns behind the router."""

    scenario: str
    produces: str = ""
    requests: int = 0
    later_turns: int = 0
    reused_tokens: int = 0
    trimmed_tokens: int = 0
    wrong_kv_tokens: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


@dataclass
class ArticleTurn:
    """One turn of the article pair: the same turn reused and recomputed."""

    turn: int
    prompt_tokens: int
    reused_model_ms: float
    recomputed_model_ms: float
    reused_measured_ms: float | None = None    # client TTFT divided by the time scale
    recomputed_measured_ms: float | None = None

    @property
    def speedup(self) -> float:
        """Recomputed over reused modelled TTFT."""
        return self.recomputed_model_ms / self.reused_model_ms if self.reused_model_ms else 0.0


@dataclass
class ArticleCheck:
    """The demo's speedup at one of the article's prompt lengths."""

    prompt_tokens: int
    article_off_ms: float
    article_on_ms: float
    turn: ArticleTurn | None

    @property
    def article_speedup(self) -> float:
        """The article's TTFT ratio."""
        return self.article_off_ms / self.article_on_ms

    @property
    def deviation(self) -> float | None:
        """The demo's speedup relative to the article's (0.05 = 5% above)."""
        return self.turn.speedup / self.article_speedup - 1.0 if self.turn is not None else None

    @property
    def within(self) -> bool:
        """Within :data:`ARTICLE_TOLERANCE`."""
        return self.deviation is not None and abs(self.deviation) <= ARTICLE_TOLERANCE


@dataclass
class AgentSummary:
    """The agent testbed's figures."""

    scenarios: list[ScenarioRow] = field(default_factory=list)
    reasons: dict[str, tuple[int, int]] = field(default_factory=dict)  # reason -> (turns, trimmed tokens)
    wrong_kv_tokens: int = 0          # from P's reports in the router's events
    engine_wrong_kv_tokens: int = 0   # from P's own events (every request P served)
    engine_reads: int = 0
    article: list[ArticleTurn] = field(default_factory=list)
    checks: list[ArticleCheck] = field(default_factory=list)
    skipped_lines: int = 0

    @property
    def article_ok(self) -> bool:
        """Every article row reproduced within the tolerance."""
        return bool(self.checks) and all(c.within for c in self.checks)

    # ------------------------------------------------------------------ terminal
    def render(self, console: Console) -> None:
        """Print the agent table, the trim reasons, the wrong-KV line and the article view (80 columns)."""
        if not self.scenarios:
            return
        table = Table(title="Agent traffic (P prefix caching off, reasoning and tool parsers)", title_justify="left")
        table.add_column("agent scenario")
        for name in ("turns", "reused", "recomputed", "wrong KV"):
            table.add_column(name, justify="right")
        for row in self.scenarios:
            table.add_row(row.scenario, str(row.later_turns), f"{row.reused_tokens:,}", f"{row.trimmed_tokens:,}",
                          str(row.wrong_kv_tokens), style="red" if row.wrong_kv_tokens else "")
        console.print(table)
        if self.reasons:
            why = ", ".join(f"{k} {n} ({t:,} tokens)" for k, (n, t) in
                            sorted(self.reasons.items(), key=lambda kv: -kv[1][0]))
            console.print(f"Why D's tokens were recomputed (turns): {why}")
        style = "red" if self.engine_wrong_kv_tokens or self.wrong_kv_tokens else "green"
        console.print(f"[{style}]Wrongly loaded KV tokens (the sim's oracle on P, {self.engine_reads} D->P reads): "
                      f"{self.engine_wrong_kv_tokens}[/{style}]")
        if not self.article:
            return
        art = Table(title=f"The article's effect: TTFT by prompt length ({AGENT_PROFILE} time model)",
                    title_justify="left")
        measured_label = "measured ms" if AGENT_TIME_SCALE == 1.0 else f"measured / {AGENT_TIME_SCALE:g}"
        for name in ("prompt tokens", "recomputed ms", "reused ms", "speedup", measured_label):
            art.add_column(name, justify="right")
        for t in self.article:
            measured = (f"{t.recomputed_measured_ms:.0f} -> {t.reused_measured_ms:.0f}"
                        if t.reused_measured_ms is not None and t.recomputed_measured_ms is not None else "–")
            art.add_row(f"{t.prompt_tokens:,}", f"{t.recomputed_model_ms:.1f}", f"{t.reused_model_ms:.1f}",
                        f"{t.speedup:.2f}x", measured)
        console.print(art)
        for c in self.checks:
            if c.turn is None:
                console.print(f"[red]article {c.prompt_tokens:,} tokens: no turn of that length[/red]")
                continue
            style = "green" if c.within else "red"
            t = c.turn
            console.print(f"[{style}]article {c.prompt_tokens:,}: {c.article_speedup:.2f}x ({c.article_off_ms:g} -> "
                          f"{c.article_on_ms:g} ms); demo {t.prompt_tokens:,}: {t.speedup:.2f}x "
                          f"({t.recomputed_model_ms:.0f} -> {t.reused_model_ms:.0f} ms), {c.deviation:+.0%}[/{style}]")

    # ------------------------------------------------------------------ HTML
    def html_sections(self) -> list[str]:
        """The HTML report's agent sections (self-contained markup)."""
        if not self.scenarios:
            return []
        rows = [[r.scenario, r.produces, r.later_turns, r.reused_tokens, r.trimmed_tokens,
                 ", ".join(f"{k} {n}" for k, n in r.reasons.most_common()), r.wrong_kv_tokens] for r in self.scenarios]
        parts = ["<h2>Agent traffic: tokens reused, reply tokens recomputed and why</h2>",
                 f'<p id="wrong-kv" data-wrong="{self.engine_wrong_kv_tokens}">Wrongly loaded KV tokens (the sim\'s '
                 f"oracle on P, {self.engine_reads} D→P reads): <strong>{self.engine_wrong_kv_tokens}</strong></p>",
                 svg.html_table(["scenario", "shows", "later turns", "tokens reused",
                                 "D's tokens recomputed (not proven)", "why (turns)", "wrongly loaded"], rows,
                                "agent-table"),
                 svg.html_table(["trim reason", "turns", "tokens recomputed"],
                                [[k, n, t] for k, (n, t) in sorted(self.reasons.items())], "trim-table")]
        if self.article:
            cats = [f"{t.prompt_tokens:,}" for t in self.article]
            values = {f"{t.prompt_tokens:,}": {"reused": svg.BarValue(t.reused_model_ms, None, 1),
                                               "recomputed": svg.BarValue(t.recomputed_model_ms, None, 1)}
                      for t in self.article}
            parts += [f"<h2>The article's effect: TTFT by prompt length ({AGENT_PROFILE} time model, P prefix "
                      "caching off)</h2>",
                      "<p>Modelled TTFT of each turn (P's leg plus D's first token, from the token counts the "
                      f"engines reported; the engines slept x{AGENT_TIME_SCALE:g} of it), the same long agent "
                      "conversation with D's KV reused and recomputed; the client-side TTFT (divided by the "
                      "time scale) beside it.</p>",
                      svg.legend_pairs([("reused", _REUSED_COLOR), ("recomputed", _RECOMPUTED_COLOR)]),
                      svg.grouped_bars("article-chart", cats, (("reused", _REUSED_COLOR),
                                                               ("recomputed", _RECOMPUTED_COLOR)),
                                       values, "TTFT ms (modelled)", "TTFT"),
                      svg.html_table(["prompt tokens", "recomputed ms", "reused ms", "speedup",
                                      "measured ÷ scale recomputed ms", "measured ÷ scale reused ms"],
                                     [[t.prompt_tokens, round(t.recomputed_model_ms, 1), round(t.reused_model_ms, 1),
                                       f"{t.speedup:.2f}×", _round(t.recomputed_measured_ms),
                                       _round(t.reused_measured_ms)] for t in self.article], "article-table"),
                      svg.html_table(["article prompt", "article ms", "article speedup", "demo prompt", "demo ms",
                                      "demo speedup", "deviation"],
                                     [[c.prompt_tokens, f"{c.article_off_ms:g} → {c.article_on_ms:g}",
                                       f"{c.article_speedup:.2f}×", c.turn.prompt_tokens if c.turn else None,
                                       (f"{c.turn.recomputed_model_ms:.0f} → {c.turn.reused_model_ms:.0f}"
                                        if c.turn else None),
                                       f"{c.turn.speedup:.2f}×" if c.turn else None,
                                       f"{c.deviation:+.1%}" if c.deviation is not None else None]
                                      for c in self.checks], "article-check")]
        return parts


def _round(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def modelled_ttft_ms(p: TurnEvent, d: TurnEvent, profile: Profile) -> float:
    """What the engines' time model spent before the first token: P's leg plus D's first token."""
    total = profile.decode_step_ms
    for ev in (p, d):
        computed = ev.computed_tokens or 0
        total += (ev.transfer_ms or 0.0) + profile.prefill_ms(computed, (ev.prompt_tokens or 0) - computed)
    return total


def _read(path: Path, stats: ReadStats) -> list[TurnEvent]:
    return list(read_events(path, strict=False, stats=stats)) if path.exists() else []


def _scenario_of(ev: TurnEvent) -> str:
    attrs = ev.attrs
    name = str(attrs.get("profile", "chat"))
    if attrs.get("include_reasoning") is False:
        name += " (hidden)"
    if attrs.get("enable_thinking") is False:
        name += " (no thinking)"
    if attrs.get("reasoning_sent_back"):
        name += " (sent back)"
    return name


def _article(client: list[TurnEvent], p_by: dict[str, TurnEvent], d_by: dict[str, TurnEvent],
             profile: Profile) -> list[ArticleTurn]:
    by_turn: dict[str, dict[int, TurnEvent]] = {ARTICLE_REUSE_ID: {}, ARTICLE_RECOMPUTE_ID: {}}
    for ev in client:
        if ev.conversation_id in by_turn and ev.status == "ok" and ev.turn is not None:
            by_turn[ev.conversation_id][ev.turn] = ev
    out = []
    for turn, reuse in sorted(by_turn[ARTICLE_REUSE_ID].items()):
        recompute = by_turn[ARTICLE_RECOMPUTE_ID].get(turn)
        if turn == 1 or recompute is None:
            continue  # turn 1 has nothing to reuse
        legs = [(p_by.get(e.request_id or ""), d_by.get(e.request_id or "")) for e in (reuse, recompute)]
        if any(p is None or d is None for p, d in legs):
            continue
        (p1, d1), (p2, d2) = legs
        assert p1 is not None and d1 is not None and p2 is not None and d2 is not None
        out.append(ArticleTurn(turn, reuse.prompt_tokens or 0, modelled_ttft_ms(p1, d1, profile),
                               modelled_ttft_ms(p2, d2, profile),
                               reuse.ttft_ms / AGENT_TIME_SCALE if reuse.ttft_ms is not None else None,
                               recompute.ttft_ms / AGENT_TIME_SCALE if recompute.ttft_ms is not None else None))
    return out


def summarize_agents(out: Path) -> AgentSummary:
    """The agent figures of a demo run in ``out`` (empty when the agent testbed did not run)."""
    stats = ReadStats()
    router = [e for e in _read(out / "agent-router-events.jsonl", stats) if e.event == "router_turn"]
    client = [e for e in _read(out / "client.jsonl", stats) if e.event == "client_turn"]
    p_events = [e for e in _read(out / "agent-prefill-events.jsonl", stats) if e.event == "prefill_request"]
    d_events = [e for e in _read(out / "agent-decode-events.jsonl", stats) if e.event == "decode_request"]
    summary = AgentSummary(skipped_lines=stats.skipped)
    if not router:
        return summary
    produces = {s.name: s.produces for s in agent_scenarios()}
    client_by = {e.request_id: e for e in client if e.request_id}
    rows: dict[str, ScenarioRow] = {name: ScenarioRow(name, what) for name, what in produces.items()}
    reasons: dict[str, list[int]] = {}
    for ev in router:
        c = client_by.get(ev.request_id or "")
        if c is None or c.attrs.get("profile") in (None, "article"):
            continue
        name = _scenario_of(c)
        row = rows.setdefault(name, ScenarioRow(name))
        row.requests += 1
        if ev.turn is not None and ev.turn > 1:
            row.later_turns += 1
        row.reused_tokens += ev.remote_read_tokens or 0
        row.trimmed_tokens += ev.trimmed_tokens or 0
        row.wrong_kv_tokens += ev.wrong_kv_tokens or 0
        if ev.trim_reason:
            row.reasons[ev.trim_reason] += 1
            entry = reasons.setdefault(ev.trim_reason, [0, 0])
            entry[0] += 1
            entry[1] += ev.trimmed_tokens or 0
    summary.scenarios = [r for r in rows.values() if r.requests]
    summary.reasons = {k: (v[0], v[1]) for k, v in reasons.items()}
    summary.wrong_kv_tokens = sum(ev.wrong_kv_tokens or 0 for ev in router)
    summary.engine_wrong_kv_tokens = sum(ev.wrong_kv_tokens or 0 for ev in p_events)
    summary.engine_reads = sum(1 for ev in p_events if (ev.remote_read_tokens or 0) > 0)
    profile = get_profile(AGENT_PROFILE)
    summary.article = _article(client, {e.request_id: e for e in p_events if e.request_id},
                               {e.request_id: e for e in d_events if e.request_id}, profile)
    for prompt, off, on in ARTICLE_ROWS:
        nearest = min(summary.article, key=lambda t: abs(t.prompt_tokens - prompt), default=None)
        if nearest is not None and abs(nearest.prompt_tokens - prompt) > prompt * 0.1:
            nearest = None
        summary.checks.append(ArticleCheck(prompt, off, on, nearest))
    return summary
