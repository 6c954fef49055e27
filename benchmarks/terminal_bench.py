"""What printing explain's terminal views costs: rich's own table layout against kvdiag's hand layout.

Two views, from synthetic conversations (kvdiag.diagnostics.report_synth): ``explain --all`` (one row per
conversation) and one long agent conversation (its turn table and each turn's details). Each is printed into a
buffer at 120 columns with rich laying out the tables (``rich``) and with kvdiag's layout (``kvdiag``; the turn
details are kvdiag's in both); the texts are checked equal (trailing spaces aside), and the CPU seconds of each
are the best of ``--repeat`` rounds.

    .venv/bin/python benchmarks/terminal_bench.py [--conversations 20000] [--turns 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import time
from collections.abc import Callable

from rich.console import Group, RenderableType

from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report_synth import SynthParams, synthetic_conversations
from kvdiag.diagnostics.terminal import explain_all_renderables, explain_renderables
from kvdiag.diagnostics.terminal_safe import safe_console
from kvdiag.diagnostics.terminal_table import QuickTable

WIDTH = 120


def _as_rich(parts: list[RenderableType]) -> list[RenderableType]:
    """The same view with rich laying out every table itself."""
    return [p.table if isinstance(p, QuickTable) else p for p in parts]


def _printed(parts: list[RenderableType]) -> tuple[float, str]:
    buf = io.StringIO()
    console = safe_console(file=buf, width=WIDTH, color_system=None, emoji=False)
    start = time.process_time()
    console.print(Group(*parts))
    return time.process_time() - start, "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def _compare(name: str, view: Callable[[], list[RenderableType]], repeat: int) -> dict[str, object]:
    best: dict[str, float] = {}
    texts: dict[str, str] = {}
    for _ in range(repeat):
        for label, parts in (("rich", _as_rich(view())), ("kvdiag", view())):
            seconds, texts[label] = _printed(parts)
            best[label] = min(best.get(label, seconds), seconds)
    if texts["rich"] != texts["kvdiag"]:
        raise SystemExit(f"{name}: the two layouts printed different text")
    return {"view": name, "lines": texts["kvdiag"].count("\n") + 1, "rich_cpu_s": round(best["rich"], 3),
            "kvdiag_cpu_s": round(best["kvdiag"], 3), "speedup": round(best["rich"] / best["kvdiag"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=20_000)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    convs = synthetic_conversations(SynthParams(conversations=args.conversations, max_turns=12))
    long = ConversationRecord(conversation_id="agent-7f3e9c2a-long-session")
    pool = [t for c in convs for t in c.turns]
    for i in range(args.turns):
        turn = pool[i % len(pool)]
        long.turns.append(type(turn)(**{**turn.__dict__, "conversation_id": long.conversation_id, "turn": i + 1}))
    print(json.dumps({"machine": f"{platform.machine()}, Python {platform.python_version()}"}))
    summaries = [c.summary() for c in convs]
    for row in (_compare(f"explain --all, {len(convs):,} conversations", lambda: explain_all_renderables(summaries),
                         args.repeat),
                _compare(f"explain --conversation, {args.turns} turns",
                         lambda: explain_renderables(long, width=WIDTH), args.repeat)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
