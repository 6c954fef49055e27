"""The multi-turn agent client behind ``kvdiag workload``.

N conversations x T turns against an OpenAI endpoint (the router, or an engine). Each turn appends a
user message or a tool result to the growing history and sends it; the reply the client received
goes back as the assistant message, so every prompt extends the previous one token for token.
Scenario turns (regenerate, duplicate, edit, disconnect; workload_plan.Scenario) produce the
verdicts of docs/design.md Contract 4. Every request becomes one ``client_turn`` TurnEvent in the
client log, and optionally one record in vLLM's multi-turn benchmark ``RequestStats`` form.

Usage::

    config = WorkloadConfig(url="http://127.0.0.1:8000", conversations=8, turns=4)
    result = asyncio.run(run_workload(config, client_log=Path("client.jsonl")))
    print(result.ttft_p50_by_turn())
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Protocol

import aiohttp

from kvdiag.schema.events import TurnEvent
from kvdiag.sim.tokenizer import render_chat, tokenize
from kvdiag.sim.workload_http import ChatResult, send_chat
from kvdiag.sim.workload_plan import (
    ConversationPlan,
    Scenario,
    TurnPlan,
    WorkloadConfig,
    make_plans,
    synthetic_text,
)

_logger = logging.getLogger(__name__)

# vLLM benchmarks/multi_turn/benchmark_serving_multi_turn.py RequestStats field order (docs/vllm-reference.md).
REQUEST_STATS_FIELDS: Final = (
    "ttft_ms", "tpot_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
    "output_num_tokens", "output_num_chunks", "output_num_first_chunk_tokens", "approx_cached_percent",
    "conversation_id", "client_id",
)

# A duplicate is sent this long after the original so that both are in flight together.
DUPLICATE_DELAY_S: Final = 0.02


@dataclass
class Conversation:
    """One conversation's plan and growing history."""

    plan: ConversationPlan
    index: int
    rng: random.Random
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_prompt: list[dict[str, Any]] | None = None  # what the last answered turn sent (for regenerate)
    last_sequence_tokens: int = 0  # prompt + reply tokens of the last answered turn
    last_end: float | None = None  # perf_counter when the last reply ended

    @property
    def conversation_id(self) -> str:
        """The plan's id (sent only when ``plan.send_id``)."""
        return self.plan.conversation_id


@dataclass(frozen=True)
class RequestRecord:
    """One request the client sent: its client_turn event and its RequestStats record."""

    event: TurnEvent
    stats: dict[str, Any]


@dataclass
class WorkloadResult:
    """Every request record of a run, and whether the duration limit cut it short."""

    records: list[RequestRecord] = field(default_factory=list)
    elapsed_s: float = 0.0
    truncated: bool = False

    def ttft_p50_by_turn(self) -> dict[int, float]:
        """Median TTFT (ms) of successful requests per turn index."""
        return ttft_p50_by_turn(r.event for r in self.records)

    def status_counts(self) -> dict[str, int]:
        """Requests per status."""
        counts: dict[str, int] = {}
        for record in self.records:
            key = record.event.status or "unknown"
            counts[key] = counts.get(key, 0) + 1
        return counts


def ttft_p50_by_turn(events: Any) -> dict[int, float]:
    """Median TTFT (ms) per turn index over ``ok`` client events that have both."""
    by_turn: dict[int, list[float]] = {}
    for ev in events:
        if ev.status == "ok" and ev.turn is not None and ev.ttft_ms is not None:
            by_turn.setdefault(ev.turn, []).append(ev.ttft_ms)
    return {turn: round(statistics.median(values), 2) for turn, values in sorted(by_turn.items())}


class ClientLogWriter:
    """Appends client_turn events as JSON lines, flushed per line so a killed run keeps its log."""

    def __init__(self, path: Path | None) -> None:
        self._fh: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("a", encoding="utf-8")

    def write(self, event: TurnEvent) -> None:
        """Write one event line."""
        if self._fh is not None:
            self._fh.write(event.to_json() + "\n")
            self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_request_stats(path: Path, records: Sequence[RequestRecord]) -> None:
    """Write the RequestStats records as one JSON array (the benchmark's --stats-json-output form)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.stats for r in records], indent=1) + "\n", encoding="utf-8")


def prompt_token_count(messages: Sequence[dict[str, Any]]) -> int:
    """Prompt tokens of ``messages`` under the sim's chat template (when the server reports no usage)."""
    return len(render_chat(messages))


class WorkloadRunner:
    """Sends the turns of conversations over one HTTP session; collects a RequestRecord per request."""

    def __init__(self, config: WorkloadConfig, session: aiohttp.ClientSession, *,
                 log: ClientLogWriter | None = None, url: str | None = None) -> None:
        self.config = config
        self.session = session
        self.url = url or config.url
        self.log = log or ClientLogWriter(None)
        self.records: list[RequestRecord] = []
        self._slots = asyncio.Semaphore(config.concurrency)

    def new_conversation(self, plan: ConversationPlan, index: int) -> Conversation:
        """A conversation with an empty history; its text is seeded from the run seed and its index."""
        return Conversation(plan=plan, index=index, rng=random.Random(f"{self.config.seed}:{index}"))

    async def run_conversation(self, conv: Conversation) -> None:
        """Run every planned turn in order, sleeping the planned gap before each."""
        for number, turn in enumerate(conv.plan.turns, start=1):
            await self.run_turn(conv, number, turn)

    async def run_turn(self, conv: Conversation, number: int, turn: TurnPlan) -> list[RequestRecord]:
        """Wait the gap, send turn ``number`` (and its duplicate), update the history; return its records."""
        if turn.gap_s > 0 and conv.last_end is not None:
            await asyncio.sleep(max(0.0, turn.gap_s - (time.perf_counter() - conv.last_end)))
        gap = None if conv.last_end is None else round(time.perf_counter() - conv.last_end, 3)
        scenario = turn.scenario
        if scenario is Scenario.REGENERATE and conv.last_prompt is not None:
            prompt = list(conv.last_prompt)
        else:
            if scenario is Scenario.REGENERATE:
                scenario = Scenario.NORMAL  # nothing answered yet to regenerate
            if scenario is Scenario.EDIT and not _strip_assistant_messages(conv.messages):
                scenario = Scenario.NORMAL
            conv.messages.append(self._new_message(conv, number, turn))
            prompt = list(conv.messages)
        max_tokens = conv.plan.max_tokens or self.config.max_tokens
        payload: dict[str, Any] = {"model": self.config.model, "messages": prompt, "max_tokens": max_tokens,
                                   "min_tokens": max_tokens, "seed": self.config.seed, "temperature": 0.0}
        if conv.plan.send_id:
            payload["conversation_id"] = conv.conversation_id
        disconnect = scenario is Scenario.DISCONNECT and self.config.stream
        async with self._slots:
            first = asyncio.create_task(self._send(payload, disconnect=disconnect))
            duplicate = None
            if scenario is Scenario.DUPLICATE:
                await asyncio.sleep(DUPLICATE_DELAY_S)
                duplicate = asyncio.create_task(self._send(payload, disconnect=False))
            results = [await first] + ([await duplicate] if duplicate is not None else [])
        records = [self._record(conv, number, prompt, res, gap, turn, scenario if i == 0 else Scenario.DUPLICATE,
                                is_duplicate=i == 1)
                   for i, res in enumerate(results)]
        main = results[0]
        if main.status in ("ok", "disconnected"):
            reply_tokens = main.completion_tokens or len(tokenize(main.text))
            conv.last_sequence_tokens = records[0].stats["input_num_tokens"] + reply_tokens
            conv.last_prompt = prompt
            conv.messages = [*prompt, {"role": "assistant", "content": main.text}]
        conv.last_end = time.perf_counter()
        return records

    def _new_message(self, conv: Conversation, number: int, turn: TurnPlan) -> dict[str, Any]:
        size = conv.plan.new_tokens or self.config.new_tokens
        if turn.tool_result:
            return {"role": "tool", "tool_call_id": f"call_{conv.index}_{number}",
                    "content": synthetic_text(conv.rng, size)}
        return {"role": "user", "content": synthetic_text(conv.rng, size)}

    async def _send(self, payload: dict[str, Any], *, disconnect: bool) -> ChatResult:
        return await send_chat(self.session, self.url, payload, request_id=uuid.uuid4().hex,
                               stream=self.config.stream or disconnect, timeout_s=self.config.request_timeout,
                               disconnect_after_first=disconnect)

    def _record(self, conv: Conversation, number: int, prompt: list[dict[str, Any]], res: ChatResult,
                gap: float | None, turn: TurnPlan, scenario: Scenario, *, is_duplicate: bool) -> RequestRecord:
        attrs: dict[str, Any] = {"scenario": scenario.value}
        if turn.long_gap:
            attrs["long_gap"] = True
        if not conv.plan.send_id:
            attrs["conversation_id_sent"] = False
        if is_duplicate:
            attrs["duplicate_of_turn"] = number
        return record_client_turn(self.log, self.records, self.config.model, conv, number, prompt, res, gap, attrs,
                                  tags=conv.plan.tags)


def _strip_assistant_messages(messages: list[dict[str, Any]]) -> bool:
    """Rewrite the history as clients that edit it do: the first message gets a stamp, every reply loses its head.

    The router reuses up to the last turn boundary a prompt still reproduces, so only an edit of
    the first message (a date stamped into the system prompt, a changed instruction) leaves no
    boundary at all (router verdict prefix_mismatch); the stripped replies alone would still let
    it reuse the first turn's prompt.
    """
    if not any(m.get("role") == "assistant" for m in messages):
        return False
    for i, message in enumerate(messages):
        if i == 0:
            messages[0] = {**message, "content": "(edited) " + str(message.get("content") or "")}
        elif message.get("role") == "assistant":
            words = str(message.get("content") or "").split(" ")
            kept = " ".join(words[len(words) // 2 + 1:]) or "(edited)"
            messages[i] = {"role": "assistant", "content": kept}
    return True


def record_client_turn(log: ClientLogWriter, records: list[RequestRecord], model: str, conv: Any, number: int,
                       prompt: Sequence[dict[str, Any]], res: ChatResult, gap: float | None, attrs: dict[str, Any], *,
                       tags: Mapping[str, Any] | None = None) -> RequestRecord:
    """One turn as the client saw it: its ``client_turn`` event written to ``log`` and its benchmark RequestStats
    kept in ``records``. ``conv`` has ``conversation_id``, ``index`` and ``last_sequence_tokens``; ``tags`` are
    added to ``attrs`` last. Token counts the server did not report are counted here."""
    prompt_tokens = res.prompt_tokens if res.prompt_tokens is not None else prompt_token_count(prompt)
    completion = res.completion_tokens if res.completion_tokens is not None else len(tokenize(res.text))
    if res.error:
        attrs["error"] = res.error
    if res.cached_tokens is not None:
        attrs["cached_tokens"] = res.cached_tokens
    attrs.update(tags or {})
    event = TurnEvent(
        ts=res.start_ts, source="client", event="client_turn", conversation_id=conv.conversation_id, turn=number,
        request_id=res.request_id, model=model, prompt_tokens=prompt_tokens, completion_tokens=completion,
        ttft_ms=res.ttft_ms, duration_ms=res.duration_ms, gap_s=gap, status=res.status,
        http_status=res.http_status, attrs=attrs)
    log.write(event)
    stats = request_stats(prompt, res, prompt_tokens, completion, previous_sequence_tokens=conv.last_sequence_tokens,
                          conversation_id=conv.conversation_id, client_id=conv.index)
    record = RequestRecord(event=event, stats=stats)
    records.append(record)
    return record


def request_stats(prompt: Sequence[dict[str, Any]], res: ChatResult, prompt_tokens: int, completion: int, *,
                  previous_sequence_tokens: int, conversation_id: str, client_id: int) -> dict[str, Any]:
    """One request's vLLM multi-turn benchmark RequestStats record."""
    ttft = res.ttft_ms if res.ttft_ms is not None else 0.0
    tpot = (res.duration_ms - ttft) / (completion - 1) if completion > 1 else 0.0
    if res.cached_tokens is not None and prompt_tokens > 0:
        cached = 100.0 * res.cached_tokens / prompt_tokens
    else:  # as the benchmark does: the share of the prompt the previous turn already covered
        cached = 100.0 * min(previous_sequence_tokens, prompt_tokens) / prompt_tokens if prompt_tokens else 0.0
    values = (round(ttft, 3), round(tpot, 3), round(res.duration_ms, 3), round(res.start_ts * 1000.0, 3),
              len(prompt), prompt_tokens, completion, res.chunks, res.first_chunk_tokens, round(cached, 2),
              conversation_id, client_id)
    return dict(zip(REQUEST_STATS_FIELDS, values, strict=True))


async def run_workload(config: WorkloadConfig, plans: Sequence[ConversationPlan] | None = None, *,
                       client_log: Path | None = None, stats_json: Path | None = None) -> WorkloadResult:
    """Run every conversation (turns in order, conversations concurrently) within ``config.duration_limit``."""
    config.validate()
    plans = list(plans) if plans is not None else make_plans(config)
    return await run_conversations(config, plans, lambda session, log: WorkloadRunner(config, session, log=log),
                                   client_log=client_log, stats_json=stats_json, what="workload")


class ConversationRunner(Protocol):
    """What run_conversations drives: conversations built from plans, run turn by turn, and their records."""

    records: list[RequestRecord]

    def new_conversation(self, plan: Any, index: int) -> Any: ...

    async def run_conversation(self, conv: Any) -> None: ...


async def run_conversations(config: WorkloadConfig, plans: Sequence[Any],
                            make_runner: Callable[[aiohttp.ClientSession, ClientLogWriter], ConversationRunner], *,
                            client_log: Path | None, stats_json: Path | None, what: str) -> WorkloadResult:
    """Every plan as a conversation (concurrently, turns in order) within ``config.duration_limit``."""
    log = ClientLogWriter(client_log)
    result = WorkloadResult()
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            runner = make_runner(session, log)
            tasks = [asyncio.create_task(runner.run_conversation(runner.new_conversation(p, i)))
                     for i, p in enumerate(plans)]
            try:
                async with asyncio.timeout(config.duration_limit):
                    await asyncio.gather(*tasks)
            except TimeoutError:
                result.truncated = True
                _logger.warning("%s stopped at the %.0f s duration limit", what, config.duration_limit)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            result.records = list(runner.records)
    finally:
        log.close()
    result.elapsed_s = round(time.perf_counter() - started, 3)
    if stats_json is not None:
        write_request_stats(stats_json, result.records)
    return result
