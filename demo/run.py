"""``kvdiag demo``: a P/D testbed on loopback that shows every per-turn verdict, then cleans up.

It starts an emulated prefill and decode engine and the router as subprocesses on free ports,
drives the phases of :mod:`kvdiag.demo.scenarios` through the router, stops everything (process
groups, SIGTERM then SIGKILL), and leaves every component's log in one folder:

    prefill.log, decode.log            stock vLLM text logs
    prefill-events.jsonl, decode-events.jsonl, router-events.jsonl, client.jsonl   TurnEvents
    proxy.log                          disagg_proxy_multiturn.py-style router log
    client-stats.json                  vLLM multi-turn benchmark RequestStats records
    agent-*                            the same for the agent testbed (kvdiag.demo.agent_phases)

Two testbeds run side by side: the verdict testbed (one P, one D, one router, tuned so that
every verdict appears) and the agent testbed (P prefix caching off, vLLM's reasoning and tool
parsers, the calibrated time model), which carries the agent scenarios and the article pair.

Usage::

    result = run_demo(Path("demo-out/run1"))
    result.summary.render(Console())
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Final

import aiohttp

from kvdiag.demo.agent_phases import AGENT_PROFILE, AGENT_TIME_SCALE, run_agent_phases
from kvdiag.demo.agent_summary import AGENT_FILES, AgentSummary, summarize_agents
from kvdiag.demo.processes import Component, ComponentError
from kvdiag.demo.scenarios import DemoTimings, FaultStep, PhaseContext, PhaseError, run_phases
from kvdiag.demo.summary import DemoSummary, summarize
from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.verdicts import Verdict
from kvdiag.sim.agent_client import AgentOptions, AgentRunner
from kvdiag.sim.workload import ClientLogWriter, WorkloadRunner, write_request_stats
from kvdiag.sim.workload_plan import WorkloadConfig

_logger = logging.getLogger(__name__)

DEMO_MODEL: Final = "Qwen/Qwen3-32B"
# Engine time model at 1/20 of the modelled durations: TTFT differences stay visible, the run stays short.
TIME_SCALE: Final = 0.05
BLOCK_SIZE: Final = 16
THRESHOLD: Final = 64
LONG_REPLY: Final = 96  # D->P remainder well above the threshold -> remote_hit
SHORT_REPLY: Final = 24  # one block < remainder < threshold -> below_threshold
NEW_TOKENS: Final = 40

OUTPUT_FILES: Final = ("prefill.log", "decode.log", "prefill-events.jsonl", "decode-events.jsonl",
                       "router-events.jsonl", "proxy.log", "client.jsonl", "client-stats.json", *AGENT_FILES)
# The agent testbed's D holds every long turn (the recomputed conversation's are never read): room for them.
AGENT_NUM_BLOCKS: Final = 65_536
AGENT_DECODE_TTL: Final = 120.0

# Phase 2, one switch at a time: on P (the reader of D's blocks), and on D for a failure unrelated to reuse
# (the router infers transfer_failed when P fails a request it handed D's handle to).
FAULT_STEPS: Final[list[FaultStep]] = [
    ("fault-transfer", "prefill", "/kvdiag/admin/faults", {"fail_transfers": {"handshake_failed": 1.0}},
     {"fail_transfers": {}}, Verdict.TRANSFER_FAILED),
    ("fault-feature-off", "prefill", "/kvdiag/admin/faults", {"bidirectional_kv_xfer": False},
     {"bidirectional_kv_xfer": True}, Verdict.FEATURE_DISABLED_ON_PREFILL),
    ("fault-request", "decode", "/kvdiag/admin/faults", {"fail_requests": 1.0}, {"fail_requests": 0.0},
     Verdict.REQUEST_FAILED),
]


class DemoError(KVDiagError, RuntimeError):
    """The demo could not run; the message says which component or phase and where its log is."""


@dataclass
class DemoResult:
    """Where the logs are, what they show, and how long it took."""

    out_dir: Path
    summary: DemoSummary
    elapsed_s: float
    timings: DemoTimings = field(default_factory=DemoTimings)
    notes: list[str] = field(default_factory=list)
    report_path: Path | None = None
    agents: AgentSummary = field(default_factory=AgentSummary)


def default_out_dir(base: Path = Path("demo-out")) -> Path:
    """A new timestamped folder under ``base``."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = base / stamp
    suffix = 1
    while path.exists():
        suffix += 1
        path = base / f"{stamp}-{suffix}"
    return path


def _engine_args(role: str, out: Path, timings: DemoTimings) -> list[str]:
    return ["sim", role, "--host", "127.0.0.1", "--port", "0", "--model", DEMO_MODEL, "--mode", "instrumented",
            "--time-scale", str(TIME_SCALE), "--block-size", str(BLOCK_SIZE),
            "--kv-recompute-threshold", str(THRESHOLD), "--decoder-kv-blocks-ttl", f"{timings.decode_ttl:g}",
            "--log-file", str(out / f"{role}.log"), "--events-file", str(out / f"{role}-events.jsonl")]


def _agent_engine_args(role: str, out: Path) -> list[str]:
    args = ["sim", role, "--host", "127.0.0.1", "--port", "0", "--model", DEMO_MODEL, "--mode", "instrumented",
            "--profile", AGENT_PROFILE, "--time-scale", str(AGENT_TIME_SCALE), "--block-size", str(BLOCK_SIZE),
            "--kv-recompute-threshold", str(THRESHOLD), "--decoder-kv-blocks-ttl", f"{AGENT_DECODE_TTL:g}",
            "--num-blocks", str(AGENT_NUM_BLOCKS), "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--log-file", str(out / f"agent-{role}.log"),
            "--events-file", str(out / f"agent-{role}-events.jsonl")]
    return [*args, "--no-prefix-caching"] if role == "prefill" else args


def _router_args(out: Path, prefill: Component, decode: Component, timings: DemoTimings, port: int,
                 prefix: str = "") -> list[str]:
    ttl = (["--decoder-kv-blocks-ttl", f"{timings.decode_ttl:g}", "--entry-ttl", f"{timings.router_ttl:g}"]
           if not prefix else ["--decoder-kv-blocks-ttl", f"{AGENT_DECODE_TTL:g}"])
    return ["router", "--host", "127.0.0.1", "--port", str(port),
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port), *ttl,
            "--events-file", str(out / f"{prefix}router-events.jsonl"), "--proxy-log", str(out / f"{prefix}proxy.log")]


class _Testbed:
    """The running components; ``close`` stops every one of them, whatever happened before."""

    def __init__(self, out: Path, timings: DemoTimings) -> None:
        self.out = out
        self.timings = timings
        self.components: dict[str, Component] = {}

    def start(self) -> None:
        for role in ("prefill", "decode"):  # all boot at once; each is registered before any wait
            self.components[role] = Component.launch(role, _engine_args(role, self.out, self.timings), self.out)
            self.components[f"agent-{role}"] = Component.launch(f"agent-{role}", _agent_engine_args(role, self.out),
                                                                self.out)
        for name in ("prefill", "decode", "agent-prefill", "agent-decode"):
            self.components[name].wait_ready()
        agent = _router_args(self.out, self.components["agent-prefill"], self.components["agent-decode"],
                             self.timings, 0, prefix="agent-")
        self.components["agent-router"] = Component.launch("agent-router", agent, self.out)
        self._start_router(0)
        self.components["agent-router"].wait_ready()

    def _start_router(self, port: int) -> None:
        args = _router_args(self.out, self.components["prefill"], self.components["decode"], self.timings, port)
        self.components["router"] = Component.start("router", args, self.out)

    async def restart_router(self) -> str:
        """Stop the router and start it again on the same port (its memory store starts empty)."""
        port = self.components["router"].port
        await asyncio.to_thread(self.components.pop("router").stop)
        try:
            await asyncio.to_thread(self._start_router, port)
        except ComponentError as exc:  # the port was taken meanwhile: a new one does as well
            _logger.warning("router restart on port %d failed (%s); using a free port", port, exc)
            await asyncio.to_thread(self._start_router, 0)
        return self.components["router"].url

    def close(self) -> list[str]:
        errors = []
        for name in ("router", "agent-router", "decode", "agent-decode", "prefill", "agent-prefill"):
            comp = self.components.pop(name, None)
            if comp is None:
                continue
            try:
                comp.stop()
            except ComponentError as exc:
                errors.append(str(exc))
        return errors


async def _drive(bed: _Testbed, keep_going: bool) -> list[str]:
    timings = bed.timings
    config = WorkloadConfig(url=bed.components["router"].url, model=DEMO_MODEL, new_tokens=NEW_TOKENS,
                            max_tokens=SHORT_REPLY, concurrency=16, request_timeout=30.0)
    ctx = PhaseContext(prefill_url=bed.components["prefill"].url, decode_url=bed.components["decode"].url,
                       restart_router=bed.restart_router, timings=timings, keep_going=keep_going)
    agent_config = WorkloadConfig(url=bed.components["agent-router"].url, model=DEMO_MODEL, concurrency=16,
                                  request_timeout=60.0, seed=0)
    log = ClientLogWriter(bed.out / "client.jsonl")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            runner = WorkloadRunner(config, session, log=log)
            agent_runners: list[AgentRunner] = []

            def agent_runner(options: AgentOptions) -> AgentRunner:
                agent_runners.append(AgentRunner(agent_config, session, options=options, log=log))
                return agent_runners[-1]

            try:
                await asyncio.gather(
                    run_phases(runner, ctx, FAULT_STEPS, long_reply=LONG_REPLY, short_reply=SHORT_REPLY),
                    run_agent_phases(agent_runner))
            finally:
                records = [*runner.records, *(r for a in agent_runners for r in a.records)]
                write_request_stats(bed.out / "client-stats.json", sorted(records, key=lambda r: r.event.ts))
    finally:
        log.close()
    return ctx.notes


def _exit_on_sigterm() -> Callable[[], None]:
    """Turn SIGTERM into SystemExit so the ``finally`` that stops the components runs; return the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def _exit(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)

    def _restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return _restore


def run_demo(out_dir: Path | None = None, *, keep_going: bool = False,
             timings: DemoTimings | None = None) -> DemoResult:
    """Run the whole demo into ``out_dir`` (default: a new folder under ./demo-out); always stops everything."""
    started = time.perf_counter()
    out = out_dir or default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    # Components append to their files: a rerun into the same folder starts from empty ones.
    consoles = [f"{prefix}{name}.console.log" for prefix in ("", "agent-") for name in ("prefill", "decode", "router")]
    for name in (*OUTPUT_FILES, "report.html", *consoles):
        (out / name).unlink(missing_ok=True)
    bed = _Testbed(out, timings or DemoTimings())
    notes: list[str] = []
    restore = _exit_on_sigterm()
    try:
        bed.start()
        notes = asyncio.run(_drive(bed, keep_going))
    except ComponentError as exc:
        raise DemoError(str(exc)) from None
    except PhaseError as exc:
        raise DemoError(f"{exc}\nLogs so far are in {out}; rerun with --keep-going to skip a failing phase.") from None
    finally:
        leftovers = bed.close()
        restore()
        if leftovers:
            raise DemoError("could not stop every component: " + "; ".join(leftovers))
    summary = summarize(out / "router-events.jsonl", out / "client.jsonl")
    agents = summarize_agents(out)
    report_path = _write_report(out, bed.timings, notes, agents)
    summary.elapsed_s = round(time.perf_counter() - started, 2)
    return DemoResult(out_dir=out, summary=summary, elapsed_s=summary.elapsed_s, timings=bed.timings, notes=notes,
                      report_path=report_path, agents=agents)


def _write_report(out: Path, timings: DemoTimings, notes: list[str], agents: AgentSummary) -> Path | None:
    """The HTML report over the run's logs; a failure is a note, never a failed demo."""
    try:
        # Imported here: pandas and the report stack cost a second at import and only this step needs them.
        from kvdiag.diagnostics.html_report import write_html_report  # noqa: PLC0415
        from kvdiag.diagnostics.report import load_turn_table  # noqa: PLC0415

        logs = [out / name for name in OUTPUT_FILES if name != "client-stats.json" and (out / name).exists()]
        table = load_turn_table(logs)
        return write_html_report(table, out / "report.html", decoder_ttl=timings.decode_ttl,
                                 title="kvdiag demo report", sections=agents.html_sections())
    except Exception as exc:  # the report is a view of the logs; the logs are the demo's result
        _logger.warning("demo: HTML report failed: %s", exc)
        notes.append(f"HTML report not written: {type(exc).__name__}: {exc}")
        return None
