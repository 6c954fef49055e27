"""``kvdiag demo``: a P/D testbed on loopback that shows every per-turn verdict, then cleans up.

It starts an emulated prefill and decode engine and the router as subprocesses on free ports,
drives the phases of :mod:`kvdiag.demo.scenarios` through the router, stops everything (process
groups, SIGTERM then SIGKILL), and leaves every component's log in one folder:

    prefill.log, decode.log            stock vLLM text logs
    prefill-events.jsonl, decode-events.jsonl, router-events.jsonl, client.jsonl   TurnEvents
    proxy.log                          disagg_proxy_multiturn.py-style router log
    client-stats.json                  vLLM multi-turn benchmark RequestStats records

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

from kvdiag.demo.processes import Component, ComponentError
from kvdiag.demo.scenarios import DemoTimings, FaultStep, PhaseContext, PhaseError, run_phases
from kvdiag.demo.summary import DemoSummary, summarize
from kvdiag.schema.verdicts import Verdict
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
                       "router-events.jsonl", "proxy.log", "client.jsonl", "client-stats.json")

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


class DemoError(RuntimeError):
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


def _router_args(out: Path, prefill: Component, decode: Component, timings: DemoTimings, port: int) -> list[str]:
    return ["router", "--host", "127.0.0.1", "--port", str(port),
            "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port),
            "--decoder-kv-blocks-ttl", f"{timings.decode_ttl:g}", "--entry-ttl", f"{timings.router_ttl:g}",
            "--events-file", str(out / "router-events.jsonl"), "--proxy-log", str(out / "proxy.log")]


class _Testbed:
    """The running components; ``close`` stops every one of them, whatever happened before."""

    def __init__(self, out: Path, timings: DemoTimings) -> None:
        self.out = out
        self.timings = timings
        self.components: dict[str, Component] = {}

    def start(self) -> None:
        for role in ("prefill", "decode"):  # both boot at once; each is registered before any wait
            self.components[role] = Component.launch(role, _engine_args(role, self.out, self.timings), self.out)
        for role in ("prefill", "decode"):
            self.components[role].wait_ready()
        self._start_router(0)

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
        for name in ("router", "decode", "prefill"):
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
    log = ClientLogWriter(bed.out / "client.jsonl")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            runner = WorkloadRunner(config, session, log=log)
            try:
                await run_phases(runner, ctx, FAULT_STEPS, long_reply=LONG_REPLY, short_reply=SHORT_REPLY)
            finally:
                write_request_stats(bed.out / "client-stats.json", runner.records)
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
    for name in (*OUTPUT_FILES, "report.html", "prefill.console.log", "decode.console.log", "router.console.log"):
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
    report_path = _write_report(out, bed.timings, notes)
    summary.elapsed_s = round(time.perf_counter() - started, 2)
    return DemoResult(out_dir=out, summary=summary, elapsed_s=summary.elapsed_s, timings=bed.timings, notes=notes,
                      report_path=report_path)


def _write_report(out: Path, timings: DemoTimings, notes: list[str]) -> Path | None:
    """The HTML report over the run's logs; a failure is a note, never a failed demo."""
    try:
        # Imported here: pandas and the report stack cost a second at import and only this step needs them.
        from kvdiag.diagnostics.html_report import write_html_report  # noqa: PLC0415
        from kvdiag.diagnostics.report import load_turn_table  # noqa: PLC0415

        logs = [out / name for name in OUTPUT_FILES if name != "client-stats.json" and (out / name).exists()]
        table = load_turn_table(logs)
        return write_html_report(table, out / "report.html", decoder_ttl=timings.decode_ttl,
                                 title="kvdiag demo report")
    except Exception as exc:  # the report is a view of the logs; the logs are the demo's result
        _logger.warning("demo: HTML report failed: %s", exc)
        notes.append(f"HTML report not written: {type(exc).__name__}: {exc}")
        return None
