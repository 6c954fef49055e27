"""Run a live check: the direct P/D probe, the router probe, the clocks; one CheckReport out.

Usage::

    report = await run_check(CheckOptions(router="http://router:8000", prefill="http://p:8100",
                                          decode="http://d:8200"))
    report.exit_code()      # 0 ok, 1 a check failed, 3 a component did not answer
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from kvdiag.check.client import Client
from kvdiag.check.conversation import DEFAULT_REPLY_TOKENS
from kvdiag.check.engines import EngineFacts, EngineProbe
from kvdiag.check.facts import clock_skews
from kvdiag.check.findings import CheckError, CheckReport, Findings, Status, Unreachable
from kvdiag.check.router_probe import RouterProbe

ENGINE_ONLY = ("models", "pd_handoff", "prefix_caching_prefill", "block_size", "decode_ttl")
FIX_REACH = {
    "prefill": "check the --prefill URL (P's OpenAI API port) and that P has finished loading",
    "decode": "check the --decode URL (D's OpenAI API port) and that D has finished loading",
    "router": "check the --router URL and that the router is running (kvdiag router --port ...)",
}


class OptionsError(CheckError):
    """The options do not describe something that can be checked; the message says what to pass."""


@dataclass(frozen=True)
class CheckOptions:
    """What to probe and how."""

    router: str | None = None
    prefill: str | None = None
    decode: str | None = None
    model: str | None = None
    api_key: str | None = None
    timeout: float = 60.0
    reply_tokens: int = DEFAULT_REPLY_TOKENS
    max_clock_skew: float = 2.0
    passive: bool = False
    metrics_wait: float = 3.0

    def validate(self) -> CheckOptions:
        """Raise OptionsError unless a router, or both P and D, are given."""
        if bool(self.prefill) != bool(self.decode):
            raise OptionsError("give both --prefill and --decode (the check plays the router between them), "
                               "or neither")
        if not (self.router or self.prefill):
            raise OptionsError("nothing to check: give --router URL, or --prefill URL and --decode URL, or all three")
        if self.reply_tokens < 1 or self.timeout <= 0 or self.max_clock_skew < 0:
            raise OptionsError("--reply-tokens must be >= 1, --timeout > 0 and --max-clock-skew >= 0")
        return self

    def targets(self) -> dict[str, str | None]:
        """The URLs checked, for the report."""
        return {"router": self.router, "prefill": self.prefill, "decode": self.decode}


def _strip(url: str | None) -> str | None:
    return url.rstrip("/") if url else None


async def run_check(options: CheckOptions) -> CheckReport:
    """Probe what ``options`` names and return every finding."""
    opts = options.validate()
    router, prefill, decode = _strip(opts.router), _strip(opts.prefill), _strip(opts.decode)
    findings = Findings()
    notes: list[str] = []
    unreachable = False
    timeout = aiohttp.ClientTimeout(total=opts.timeout, connect=min(10.0, opts.timeout))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = Client(session, opts.api_key)
        facts: EngineFacts | None = None
        try:
            if prefill and decode:
                probe = EngineProbe(client, prefill, decode, findings, model_wanted=opts.model,
                                    reply_tokens=opts.reply_tokens, metrics_wait=opts.metrics_wait)
                facts = probe.facts
                if await probe.discover() and not opts.passive:
                    await probe.prefix_caching()
                    await probe.conversation()
                probe.block_sizes()
            if router:
                rprobe = RouterProbe(client, router, findings, facts,
                                     model=facts.model if facts is not None and facts.model else opts.model,
                                     reply_tokens=opts.reply_tokens, metrics_wait=opts.metrics_wait, p_url=prefill)
                await rprobe.discover()
                if not opts.passive:
                    await rprobe.conversation()
        except Unreachable as exc:
            unreachable = True
            findings.add(f"{exc.component}_reachable", Status.FAIL, f"{exc.url} did not answer: {exc.reason}",
                         FIX_REACH.get(exc.component))
            notes.append("the check stopped at the first component that did not answer")
        _clocks(client, findings, opts.max_clock_skew)
    _skips(findings, opts, unreachable)
    return CheckReport(opts.targets(), findings.ordered(), notes, unreachable)


def _clocks(client: Client, findings: Findings, limit: float) -> None:
    skews = clock_skews(client.clocks)
    if not skews:
        findings.add("clocks", Status.UNKNOWN, "cannot tell: no answer carried a Date header")
        return
    shown = "; ".join(s.describe() for s in skews)
    off = [s for s in skews if s.beyond(limit)]
    if off:
        findings.add("clocks", Status.FAIL, f"{', '.join(s.component for s in off)} off by more than {limit:g} s "
                     f"from this machine ({shown}): logs and events from different hosts no longer line up "
                     "(explain's gaps and TTL comparisons)", "run NTP (chrony, systemd-timesyncd) on every node",
                     [f"Date headers against local time: {shown}"])
    else:
        findings.add("clocks", Status.PASS, f"within {limit:g} s of this machine ({shown}; Date headers have 1 s "
                     "resolution)")


def _skips(findings: Findings, opts: CheckOptions, unreachable: bool) -> None:
    why = "not run: a component did not answer" if unreachable else None
    if not opts.prefill:
        for check_id in (*ENGINE_ONLY, "prefill_reachable", "decode_reachable"):
            findings.skip(check_id, why or "not run: give --prefill and --decode to probe the engines directly")
    if not opts.router:
        for check_id in ("router_reachable", "router_ttl", "router_decode_ttl", "conversation_id", "router_state",
                         "request_ids"):
            findings.skip(check_id, why or "not run: give --router")
    if opts.passive:
        for check_id in ("pd_handoff", "stream_kv_params", "bidirectional_decode", "bidirectional_prefill",
                         "d2p_read", "prefix_caching_prefill", "decode_ttl", "conversation_id", "router_state",
                         "request_ids"):
            findings.skip(check_id, "not run: --passive sends no traffic")
    for check_id in ("pd_handoff", "stream_kv_params", "bidirectional_decode", "bidirectional_prefill", "d2p_read",
                     "decode_ttl", "router_decode_ttl", "block_size", "prefix_caching_prefill", "router_ttl"):
        findings.skip(check_id, why or "not run: an earlier step failed")
