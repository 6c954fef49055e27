"""The agent client behind ``kvdiag workload --profile``: sends back what a real agent client sends.

Each turn follows its plan (:mod:`kvdiag.sim.agent_plan`): the history gets the task, a user
message, one ``tool`` message per tool call of the previous reply (``tool_call_id`` from the call),
the answers of sub-agents, a summary in place of the whole history, an edit or a regeneration;
then the request asks for the planned reply through the sim's ``kvdiag_sim`` hint, with the
profile's ``tools``. The reply goes back into the history as an agent framework keeps it: an
assistant message with the content (null when the reply was only tool calls) and the tool calls
as structured ``tool_calls`` (id, name, the arguments string as received); the reasoning is not
sent back, unless ``send_reasoning`` (then as ``reasoning_content``). ``hide_reasoning`` asks
for ``include_reasoning: false``, ``thinking=False`` for Qwen3's non-thinking mode. Every
request becomes one ``client_turn`` event.

Usage::

    spec = AgentSpec(profile="coding-agent", conversations=2, seed=1)
    result = asyncio.run(run_agent_workload(WorkloadConfig(url="http://127.0.0.1:8000"), spec,
                                            client_log=Path("client.jsonl")))
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

from kvdiag.sim.agent_plan import TOOLS, AgentPlan, AgentSpec, AgentTurn, Reply, Step, make_agent_plans
from kvdiag.sim.workload import (
    ClientLogWriter,
    RequestRecord,
    WorkloadResult,
    record_client_turn,
    run_conversations,
)
from kvdiag.sim.workload_http import ChatResult, send_chat
from kvdiag.sim.workload_plan import WorkloadConfig, synthetic_text

_logger = logging.getLogger(__name__)

SUMMARY_REQUEST: Final = "Summarize the work so far: the task, what was found, what is left to do."
CONTINUE: Final = "Continue the task from this summary of the work so far:\n\n"

# Called after every answered request, before the conversation's next one: (conversation, turn, body, result).
TurnHook = Callable[["AgentConversation", int, dict[str, Any], ChatResult], Awaitable[None]]


@dataclass(frozen=True)
class AgentOptions:
    """How the client sends replies back and what it asks for."""

    send_reasoning: bool = False  # the reasoning goes back as reasoning_content
    hide_reasoning: bool = False  # include_reasoning: false
    thinking: bool = True         # False: chat_template_kwargs {"enable_thinking": false} (Qwen3's non-thinking mode)


@dataclass
class AgentConversation:
    """One conversation's plan and history."""

    plan: AgentPlan
    index: int
    rng: random.Random
    system_text: str
    shared_task: str | None = None     # sub-agents: the parent's task message (the shared prefix)
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_prompt: list[dict[str, Any]] | None = None
    last_result: ChatResult | None = None
    last_prompt_tokens: int = 0
    last_sequence_tokens: int = 0
    last_end: float | None = None
    summary_due: bool = False
    compact_next: bool = False
    final_text: str = ""               # the last reply's content (a sub-agent's answer)
    turns_sent: int = 0

    @property
    def conversation_id(self) -> str:
        """The plan's id."""
        return self.plan.conversation_id


class AgentRunner:
    """Runs agent conversations over one HTTP session; one RequestRecord per request."""

    def __init__(self, config: WorkloadConfig, session: aiohttp.ClientSession, *, options: AgentOptions | None = None,
                 log: ClientLogWriter | None = None, url: str | None = None, on_turn: TurnHook | None = None) -> None:
        self.config = config
        self.session = session
        self.options = options or AgentOptions()
        self.url = url or config.url
        self.log = log or ClientLogWriter(None)
        self.on_turn = on_turn
        self.records: list[RequestRecord] = []
        self._slots = asyncio.Semaphore(config.concurrency)

    def new_conversation(self, plan: AgentPlan, index: int, *, system_text: str | None = None,
                         shared_task: str | None = None) -> AgentConversation:
        """A conversation with an empty history; its text is seeded from the run seed and its id."""
        rng = random.Random(f"{self.config.seed}:{plan.conversation_id}")
        system = system_text if system_text is not None else synthetic_text(rng, plan.system_tokens,
                                                                             prefix="You are a coding agent.")
        return AgentConversation(plan, index, rng, system, shared_task)

    async def run_conversation(self, conv: AgentConversation) -> None:
        """Run every planned turn in order."""
        for number, turn in enumerate(conv.plan.turns, start=1):
            await self.run_turn(conv, number, turn)

    # ------------------------------------------------------------------ one turn
    async def run_turn(self, conv: AgentConversation, number: int, turn: AgentTurn) -> RequestRecord:
        """Wait the gap, change the history as planned, send the request, keep the reply."""
        if turn.gap_s > 0 and conv.last_end is not None:
            await asyncio.sleep(max(0.0, turn.gap_s - (time.perf_counter() - conv.last_end)))
        gap = None if conv.last_end is None else round(time.perf_counter() - conv.last_end, 3)
        step, reply = await self._prepare(conv, number, turn)
        prompt = list(conv.last_prompt or conv.messages) if step is Step.REGENERATE else list(conv.messages)
        body = self._body(conv, prompt, reply)
        async with self._slots:
            result = await send_chat(self.session, self.url, body, request_id=uuid.uuid4().hex,
                                     stream=self.config.stream, timeout_s=self.config.request_timeout,
                                     first_output=True)
        record = self._record(conv, number, prompt, result, gap, step)
        conv.turns_sent += 1
        if result.status == "ok":
            conv.last_prompt = list(prompt)
            conv.last_result = result
            conv.last_prompt_tokens = record.event.prompt_tokens or 0
            conv.last_sequence_tokens = conv.last_prompt_tokens + (record.event.completion_tokens or 0)
            conv.messages = [*prompt, result.assistant_message(send_reasoning=self.options.send_reasoning)]
            conv.final_text = result.text
            over = conv.plan.compact_over
            conv.summary_due = over is not None and conv.last_prompt_tokens > over and step is not Step.SUMMARIZE
            if self.on_turn is not None:
                await self.on_turn(conv, number, body, result)
        conv.last_end = time.perf_counter()
        return record

    async def _prepare(self, conv: AgentConversation, number: int, turn: AgentTurn) -> tuple[Step, Reply]:
        """Apply the turn's history change; return the step actually taken and the reply to ask for."""
        step, reply = turn.step, turn.reply
        last = conv.last_result
        calls = last.tool_calls if last is not None else []
        if conv.compact_next:
            conv.compact_next = False
            summary = conv.final_text or "(no summary)"
            conv.messages = [self._system(conv), {"role": "user", "content": CONTINUE + summary}]
            return Step.COMPACTED, reply
        if step is Step.TASK or not conv.messages:
            conv.messages = [self._system(conv)]
            if conv.shared_task is not None:
                conv.messages.append({"role": "user", "content": conv.shared_task})
            conv.messages.append({"role": "user", "content": self._text(conv, turn, 0)})
            return Step.TASK, reply
        if step in (Step.TOOL_RESULTS, Step.SUB_AGENTS) and not calls:
            step = Step.USER  # the reply made no call (cut short, or the model answered): the user goes on
        if step is Step.SUB_AGENTS:
            answers = await self._run_sub_agents(conv, number, len(calls))
            self._tool_results(conv, calls, answers)
        elif step is Step.TOOL_RESULTS:
            self._tool_results(conv, calls, [synthetic_text(conv.rng, turn.tokens[i % len(turn.tokens)] if turn.tokens
                                                            else 50) for i in range(len(calls))])
        elif step is Step.REGENERATE:
            if conv.last_prompt is None:
                step = Step.USER
        elif step is Step.EDIT_LAST_USER:
            if conv.last_prompt and conv.last_prompt[-1].get("role") == "user":
                edited = _rewrite_tail(str(conv.last_prompt[-1].get("content") or ""), conv.rng, 0.4)
                conv.messages = [*conv.last_prompt[:-1], {"role": "user", "content": edited}]
                return step, reply
            step = Step.USER
        elif step is Step.EDIT_REPLY:
            if conv.messages[-1].get("role") == "assistant" and conv.messages[-1].get("content"):
                message = dict(conv.messages[-1])
                message["content"] = _rewrite_tail(str(message["content"]), conv.rng, 0.3)
                conv.messages[-1] = message
            else:
                step = Step.USER
        elif step is Step.EDIT_HISTORY:
            users = [i for i, m in enumerate(conv.messages[:-1]) if m.get("role") == "user"]
            if len(users) > 1:
                i = users[conv.rng.randrange(len(users) - 1)]
                conv.messages[i] = {"role": "user",
                                    "content": _rewrite_tail(str(conv.messages[i].get("content") or ""), conv.rng, 0.1)}
            else:
                step = Step.USER
        if step in (Step.USER, Step.EDIT_REPLY, Step.EDIT_HISTORY):
            conv.messages.append({"role": "user", "content": self._text(conv, turn, 0)})
        if conv.summary_due and step is not Step.REGENERATE:
            # Compaction: answer what is pending, then ask for the summary the history is replaced by.
            conv.summary_due = False
            conv.compact_next = True
            conv.messages.append({"role": "user", "content": SUMMARY_REQUEST})
            return Step.SUMMARIZE, Reply(reasoning_tokens=reply.reasoning_tokens,
                                         content_tokens=conv.plan.summary_tokens)
        return step, reply

    def _system(self, conv: AgentConversation) -> dict[str, Any]:
        return {"role": "system", "content": conv.system_text}

    def _text(self, conv: AgentConversation, turn: AgentTurn, i: int) -> str:
        size = turn.tokens[i % len(turn.tokens)] if turn.tokens else 60
        return synthetic_text(conv.rng, size)

    @staticmethod
    def _tool_results(conv: AgentConversation, calls: Sequence[dict[str, Any]], outputs: Sequence[str]) -> None:
        for call, output in zip(calls, outputs, strict=False):
            conv.messages.append({"role": "tool", "tool_call_id": call.get("id") or "call", "content": output})

    async def _run_sub_agents(self, conv: AgentConversation, number: int, wanted: int) -> list[str]:
        plans = conv.plan.subagents_at(number)[:wanted]
        task = conv.messages[1]["content"] if len(conv.messages) > 1 else ""
        subs = [self.new_conversation(p, conv.index * 100 + j, system_text=conv.system_text, shared_task=str(task))
                for j, p in enumerate(plans)]
        await asyncio.gather(*(self.run_conversation(s) for s in subs))
        answers = [s.final_text or "(no answer)" for s in subs]
        return answers + [synthetic_text(conv.rng, 40)] * (wanted - len(answers))

    def _body(self, conv: AgentConversation, prompt: list[dict[str, Any]], reply: Reply) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.config.model, "messages": prompt, "max_tokens": reply.max_tokens(),
                                "seed": self.config.seed, "temperature": 0.0, "kvdiag_sim": reply.hint()}
        if conv.plan.tools:
            body["tools"] = [dict(t) for t in TOOLS]
            body["tool_choice"] = "auto"
        if self.options.hide_reasoning:
            body["include_reasoning"] = False
        if not self.options.thinking:
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if conv.plan.send_id and self.config.send_conversation_id:
            body["conversation_id"] = conv.conversation_id
        return body

    def _record(self, conv: AgentConversation, number: int, prompt: list[dict[str, Any]], res: ChatResult,
                gap: float | None, step: Step) -> RequestRecord:
        attrs: dict[str, Any] = {"scenario": step.value, "profile": conv.plan.profile}
        if res.tool_calls:
            attrs["tool_calls"] = len(res.tool_calls)
        if self.options.send_reasoning:
            attrs["reasoning_sent_back"] = True
        if self.options.hide_reasoning:
            attrs["include_reasoning"] = False
        if not self.options.thinking:
            attrs["enable_thinking"] = False
        if not (conv.plan.send_id and self.config.send_conversation_id):
            attrs["conversation_id_sent"] = False
        return record_client_turn(self.log, self.records, self.config.model, conv, number, prompt, res, gap, attrs)


def _rewrite_tail(text: str, rng: random.Random, share: float) -> str:
    """``text`` with its last ``share`` of words replaced by other words (a client's edit)."""
    words = text.split(" ")
    keep = max(1, round(len(words) * (1.0 - share)))
    return " ".join(words[:keep]) + " " + synthetic_text(rng, max(1, len(words) - keep))


async def run_agent_workload(config: WorkloadConfig, spec: AgentSpec, *, options: AgentOptions | None = None,
                             plans: Sequence[AgentPlan] | None = None, client_log: Path | None = None,
                             stats_json: Path | None = None, on_turn: TurnHook | None = None) -> WorkloadResult:
    """Run every conversation of ``spec`` (concurrently, turns in order) within ``config.duration_limit``."""
    config.validate()
    plans = list(plans) if plans is not None else make_agent_plans(spec)
    return await run_conversations(
        config, plans, lambda session, log: AgentRunner(config, session, options=options, log=log, on_turn=on_turn),
        client_log=client_log, stats_json=stats_json, what="agent workload")
