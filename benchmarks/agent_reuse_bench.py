"""Agent traffic behind kvdiag router: reused tokens against a perfect-knowledge router, and wrongly loaded KV.

For each agent profile of ``kvdiag workload`` (and the client variants that hide or send back the
reasoning) this runs the workload through a real router in front of emulated P and D engines on
loopback (P prefix caching off, as in the article, so every reused token is a D->P read) and
compares, turn by turn:

* ``reused``: the tokens P read from D (P's report in the router's events);
* ``perfect``: what a router that knew every token id would have let P read (kvdiag.sim.agent_oracle:
  the longest common token prefix of D's sequence and the new prompt, whole blocks, vLLM's caps);
* ``wrong``: KV P loaded for other token ids (the sim's oracle; must be 0).

Router modes: ``text`` (the default rule), ``text`` with P's exact mode on, ``verify`` (the router's
--verify-tokens), ``text-noprefix`` (the default rule with --no-tokenize-shared-prefix: turn
boundaries only), and the negative control ``full`` (the rule patched to inject D's whole handle,
P's exact mode off: the old proxy behaviour), which must load wrong KV.

    .venv/bin/python benchmarks/agent_reuse_bench.py [--seed 1] [--conversations 2] [--scale 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvdiag.router import reuse as router_reuse
from kvdiag.router import reuse_rule
from kvdiag.router.app import start_router
from kvdiag.router.config import RouterConfig, Upstream
from kvdiag.schema.events import read_events
from kvdiag.sim.agent_client import AgentOptions, run_agent_workload
from kvdiag.sim.agent_oracle import PerfectOracle
from kvdiag.sim.agent_plan import REASONING_PROFILES, AgentSpec
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.server import start_engine
from kvdiag.sim.workload_plan import WorkloadConfig

BLOCK_SIZE = 16
THRESHOLD = 64
TARGET_SHARE = 0.9


@dataclass(frozen=True)
class Case:
    """One workload: a profile and how the client treats the reasoning."""

    profile: str
    # default | hidden (include_reasoning false) | sent_back (reasoning_content) | no_thinking (enable_thinking false)
    variant: str = "default"

    @property
    def label(self) -> str:
        """``profile`` or ``profile (variant)``."""
        return self.profile if self.variant == "default" else f"{self.profile} ({self.variant})"

    @property
    def options(self) -> AgentOptions:
        """The client options of the variant."""
        return AgentOptions(send_reasoning=self.variant == "sent_back", hide_reasoning=self.variant == "hidden",
                            thinking=self.variant != "no_thinking")

    @property
    def reasoning(self) -> bool:
        """Whether the engines run a reasoning parser (a reasoning model)."""
        return self.profile in REASONING_PROFILES


CASES: tuple[Case, ...] = (
    Case("coding-agent"), Case("coding-agent", "sent_back"),
    Case("reasoning-chat"), Case("reasoning-chat", "hidden"), Case("reasoning-chat", "sent_back"),
    Case("parallel-tools"), Case("parallel-tools", "no_thinking"), Case("sub-agents"), Case("compaction"),
    Case("edits"),
)


@dataclass(frozen=True)
class Mode:
    """How the router and P run."""

    name: str
    exact: bool = False        # P's exact mode (instrumented P reads only what D's digest proves)
    verify: bool = False       # the router's --verify-tokens
    full_handle: bool = False  # negative control: inject D's whole handle
    shared_prefix: bool = True  # the router's --tokenize-shared-prefix (off: turn boundaries only)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("text"), Mode("text+exact", exact=True), Mode("verify", verify=True), Mode("full", full_handle=True),
    Mode("text-noprefix", shared_prefix=False))}


@dataclass
class RunResult:
    """One case in one mode."""

    case: str
    mode: str
    requests: int = 0
    later_turns: int = 0
    reused: int = 0
    perfect: int = 0
    wrong: int = 0            # the P engine's oracle total (every read)
    wrong_events: int = 0     # the same from P's reports in the router's events
    over_perfect_turns: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)  # the client's history changes (attrs.scenario)
    outcomes: dict[str, int] = field(default_factory=dict)
    trim_reasons: dict[str, int] = field(default_factory=dict)
    trimmed: int = 0
    shared_prefix: dict[str, int] = field(default_factory=dict)  # --tokenize-shared-prefix lookups by outcome
    shared_prefix_ms: list[float] = field(default_factory=list)  # and what each took (the /tokenize calls)
    elapsed_s: float = 0.0
    short_turns: list[dict[str, Any]] = field(default_factory=list)  # turns far below perfect (why)

    @property
    def share(self) -> float | None:
        """reused / perfect over the later turns."""
        return self.reused / self.perfect if self.perfect else None


def _always_full(coverage: Any, view: Any, *, handle_tokens: int, block_size: Any, margin: int = 8) -> Any:
    return reuse_rule.Decision(reuse_rule.Reuse.FULL, handle_tokens)


@contextlib.contextmanager
def full_handle_rule(active: bool) -> Iterator[None]:
    """Replace the router's reuse rule by "always the full handle" (the negative control) while active."""
    if not active:
        yield
        return
    original = router_reuse.decide
    router_reuse.decide = _always_full  # type: ignore[assignment]
    try:
        yield
    finally:
        router_reuse.decide = original  # type: ignore[assignment]


def _engine(role: str, case: Case, mode: Mode, events: Path | None) -> EngineConfig:
    parsers: dict[str, Any] = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    if case.reasoning:
        parsers["reasoning_parser"] = "qwen3"
    return EngineConfig(role=role, time_scale=0.0, mode="instrumented", block_size=BLOCK_SIZE,
                        kv_recompute_threshold=THRESHOLD, prefix_caching=role == "decode",
                        pull_matching_prefix=mode.exact, num_blocks=65_536,
                        events_file=str(events) if events else None, **parsers)


async def run_case(case: Case, mode: Mode, spec: AgentSpec, workdir: Path, *, stream: bool = True) -> RunResult:
    """Run one case through a fresh P, D and router; return the figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    router_events = workdir / "router-events.jsonl"
    p = await start_engine(_engine("prefill", case, mode, workdir / "prefill-events.jsonl"))
    d = await start_engine(_engine("decode", case, mode, None))
    oracle = PerfectOracle(p.url, d.engine, block_size=BLOCK_SIZE, threshold=THRESHOLD)
    started = time.perf_counter()
    try:
        with full_handle_rule(mode.full_handle):
            router = await start_router(RouterConfig(
                prefill=(Upstream("127.0.0.1", p.port),), decode=(Upstream("127.0.0.1", d.port),),
                host="127.0.0.1", port=0, events_file=router_events, verify_tokens=mode.verify,
                tokenize_shared_prefix=mode.shared_prefix))
            try:
                config = WorkloadConfig(url=router.url, conversations=spec.conversations, concurrency=8,
                                        stream=stream, seed=spec.seed, duration_limit=1800.0, request_timeout=120.0)
                result = await run_agent_workload(config, spec, options=case.options, on_turn=oracle.on_turn)
            finally:
                await router.close()
    finally:
        await oracle.close()
        wrong_total = p.engine.wrong_kv_tokens
        await p.close()
        await d.close()
    out = RunResult(case.label, mode.name, requests=len(result.records), wrong=wrong_total,
                    elapsed_s=round(time.perf_counter() - started, 2))
    out.statuses = dict(Counter(r.event.status or "?" for r in result.records))
    out.steps = dict(Counter(str(r.event.attrs.get("scenario")) for r in result.records))
    events = {e.request_id: e for e in read_events(router_events) if e.event == "router_turn"}
    out.outcomes = dict(Counter(e.outcome or "none" for e in events.values()))
    learned = [e.attrs for e in events.values() if "shared_prefix" in e.attrs]
    out.shared_prefix = dict(Counter(str(a["shared_prefix"]) for a in learned))
    out.shared_prefix_ms = [float(a["shared_prefix_ms"]) for a in learned if a["shared_prefix"] == "tokenized"]
    reasons: Counter[str] = Counter()
    for truth in oracle.turns:
        if truth.perfect_tokens is None or truth.request_id is None:
            continue
        ev = events.get(truth.request_id)
        read = (ev.remote_read_tokens or 0) if ev is not None else 0
        out.later_turns += 1
        out.perfect += truth.perfect_tokens
        out.reused += read
        if ev is not None:
            out.wrong_events += ev.wrong_kv_tokens or 0
            out.trimmed += ev.trimmed_tokens or 0
            if ev.trim_reason:
                reasons[ev.trim_reason] += 1
        if read > truth.perfect_tokens:
            out.over_perfect_turns += 1
        if truth.perfect_tokens - read > max(BLOCK_SIZE * 4, truth.perfect_tokens // 10):
            out.short_turns.append({
                "conversation": truth.conversation_id, "turn": truth.turn, "read": read,
                "perfect": truth.perfect_tokens, "prompt": truth.prompt_tokens, "outcome": ev.outcome if ev else None,
                "trim_reason": ev.trim_reason if ev else None,
                "detail": str(ev.attrs.get("reuse_detail", ""))[:160] if ev else ""})
    out.trim_reasons = dict(reasons)
    return out


async def run_all(cases: tuple[Case, ...], modes: list[Mode], *, conversations: int, seed: int, scale: float,
                  workdir: Path) -> list[RunResult]:
    """Every case in every mode, one at a time (each on fresh engines)."""
    results = []
    for case in cases:
        spec = AgentSpec(profile=case.profile, conversations=conversations, seed=seed, scale=scale, prefix="bench")
        for mode in modes:
            res = await run_case(case, mode, spec, workdir / f"{case.profile}-{case.variant}-{mode.name}")
            ms = sorted(res.shared_prefix_ms)
            learned = (f" shared-prefix {res.shared_prefix} (/tokenize p50 {ms[len(ms) // 2]:.2f} ms)" if ms
                       else f" shared-prefix {res.shared_prefix}" if res.shared_prefix else "")
            print(f"{res.case:32s} {res.mode:13s} requests {res.requests:4d} reused {res.reused:8d} perfect "
                  f"{res.perfect:8d} share {res.share or 0:.3f} wrong {res.wrong}{learned} ({res.elapsed_s:.1f} s)",
                  file=sys.stderr, flush=True)
            results.append(res)
    return results


def table(results: list[RunResult]) -> str:
    """The BENCHMARKS.md table: one row per case, the modes side by side."""
    by: dict[str, dict[str, RunResult]] = {}
    for r in results:
        by.setdefault(r.case, {})[r.mode] = r
    head = ("| profile | later turns | perfect tokens | reused (text rule) | share | wrong | share, exact mode on "
            "| wrong | reused (--verify-tokens) | share | wrong | negative control: wrong tokens |")
    lines = [head, "|" + "---|" * 12]

    def share(r: RunResult | None) -> str:
        return f"{r.share:.1%}" if r is not None and r.share is not None else "–"

    for case, modes in by.items():
        t, e, v, f = (modes.get(m) for m in ("text", "text+exact", "verify", "full"))
        base = t or e or v
        assert base is not None
        cells = [case, str(base.later_turns), f"{base.perfect:,}",
                 f"{t.reused:,}" if t else "–", share(t), str(t.wrong) if t else "–",
                 share(e), str(e.wrong) if e else "–",
                 f"{v.reused:,}" if v else "–", share(v), str(v.wrong) if v else "–",
                 f"{f.wrong:,}" if f else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="message and tool-output sizes times this")
    parser.add_argument("--modes", default="text,text+exact,verify,full",
                        help=f"comma-separated, of {', '.join(MODES)} (text-noprefix: --no-tokenize-shared-prefix)")
    parser.add_argument("--cases", default="", help="comma-separated profile[:variant] (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    modes = [MODES[m] for m in args.modes.split(",")]
    cases = CASES
    if args.cases:
        wanted = [c.split(":") for c in args.cases.split(",")]
        cases = tuple(Case(w[0], w[1] if len(w) > 1 else "default") for w in wanted)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = asyncio.run(run_all(cases, modes, conversations=args.conversations, seed=args.seed,
                                      scale=args.scale, workdir=Path(tmp)))
    elapsed = time.perf_counter() - started
    print(table(results))
    print(f"\n{platform.node()} {platform.machine()}, python {platform.python_version()}, {elapsed:.0f} s")
    for r in results:
        if r.short_turns and r.mode in ("text", "verify"):
            print(f"\n{r.case} [{r.mode}]: {len(r.short_turns)} turn(s) well below perfect, e.g. "
                  + json.dumps(r.short_turns[:3]))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) | {"share": r.share} for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
