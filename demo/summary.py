"""The demo's closing summary: outcomes from the router's events, reuse, TTFT by turn from the client log.

Usage::

    summary = summarize(out_dir / "router-events.jsonl", out_dir / "client.jsonl")
    summary.render(Console())
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvdiag.schema.events import ReadStats, TurnEvent, read_events
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS, Verdict
from kvdiag.sim.workload import ttft_p50_by_turn

# Verdicts the router decides or reports; ``unknown`` is explain's answer when logs are missing.
EXPECTED_VERDICTS: tuple[Verdict, ...] = tuple(v for v in Verdict if v is not Verdict.UNKNOWN)


@dataclass
class DemoSummary:
    """What one demo run produced."""

    outcomes: Counter[str] = field(default_factory=Counter)
    router_turns: int = 0
    client_requests: int = 0
    client_status: Counter[str] = field(default_factory=Counter)
    ttft_p50_by_turn: dict[int, float] = field(default_factory=dict)
    ttft_p50_by_outcome: dict[str, float] = field(default_factory=dict)
    skipped_lines: int = 0
    elapsed_s: float = 0.0

    @property
    def reused(self) -> int:
        """Turns whose history came from a cache (remote_hit + local_hit)."""
        return sum(n for name, n in self.outcomes.items() if _verdict(name) in REUSED_VERDICTS)

    @property
    def eligible(self) -> int:
        """Later turns that could have reused KV."""
        return sum(n for name, n in self.outcomes.items() if _verdict(name) in ELIGIBLE_VERDICTS)

    @property
    def missing(self) -> list[Verdict]:
        """Expected verdicts no router event carried."""
        return [v for v in EXPECTED_VERDICTS if self.outcomes.get(v.value, 0) == 0]

    def render(self, console: Console, how: dict[Verdict, str] | None = None) -> None:
        """Print the outcome table (``how``: what produced each verdict), the reuse line, TTFT by turn."""
        table = Table(title=f"Turn outcomes (router events, {self.router_turns} turns)", title_justify="left")
        table.add_column("verdict")
        table.add_column("turns", justify="right")
        if how is not None:
            table.add_column("produced by")
        # No TTFT per verdict here: at the demo's scaled-down time model and tiny prompts, the
        # differences between verdicts are smaller than loopback noise on a busy machine.
        for verdict in EXPECTED_VERDICTS:
            count = self.outcomes.get(verdict.value, 0)
            style = "green" if verdict in REUSED_VERDICTS else ("red" if count == 0 else "")
            cells = [verdict.value, str(count)] + ([how.get(verdict, "")] if how is not None else [])
            table.add_row(*cells, style=style)
        console.print(table)
        share = 100.0 * self.reused / self.eligible if self.eligible else 0.0
        console.print(f"Turns that reused KV: {self.reused} of {self.eligible} eligible later turns ({share:.0f}%)")
        status = ", ".join(f"{k} {v}" for k, v in sorted(self.client_status.items()))
        console.print(f"Client requests: {self.client_requests} ({status})")
        if self.ttft_p50_by_turn:
            turn_cells = "  ".join(f"t{turn}: {p50:.1f}" for turn, p50 in self.ttft_p50_by_turn.items())
            console.print(f"TTFT p50 ms by turn index: {turn_cells}")
        if self.skipped_lines:
            console.print(f"[yellow]{self.skipped_lines} corrupt event line(s) skipped[/yellow]")
        if self.missing:
            console.print(f"[red]Verdicts not produced: {', '.join(v.value for v in self.missing)}[/red]")


def _verdict(name: str) -> Verdict | None:
    try:
        return Verdict(name)
    except ValueError:
        return None


def _read(path: Path, stats: ReadStats) -> list[TurnEvent]:
    if not path.exists():
        return []
    return list(read_events(path, strict=False, stats=stats))


def summarize(router_events: Path, client_log: Path) -> DemoSummary:
    """Count outcomes from the router's events and TTFT from the client log (corrupt lines skipped).

    TTFT by turn covers the requests this router served (the client log also holds the agent testbed's).
    """
    stats = ReadStats()
    router = [e for e in _read(router_events, stats) if e.event == "router_turn"]
    client = [e for e in _read(client_log, stats) if e.event == "client_turn"]
    summary = DemoSummary(skipped_lines=stats.skipped, router_turns=len(router), client_requests=len(client))
    summary.outcomes.update(e.outcome or "none" for e in router)
    summary.client_status.update(e.status or "unknown" for e in client)
    routed = {e.request_id for e in router if e.request_id}
    summary.ttft_p50_by_turn = ttft_p50_by_turn(e for e in client if e.request_id in routed)
    # Join on the request id the client saw (the router echoes X-Request-Id) for TTFT per verdict.
    outcome_by_request = {e.request_id: e.outcome for e in router if e.request_id and e.outcome}
    by_outcome: dict[str, list[float]] = {}
    for ev in client:
        outcome = outcome_by_request.get(ev.request_id or "")
        if outcome and ev.status == "ok" and ev.ttft_ms is not None:
            by_outcome.setdefault(outcome, []).append(ev.ttft_ms)
    summary.ttft_p50_by_outcome = {k: round(statistics.median(v), 2) for k, v in by_outcome.items()}
    return summary
