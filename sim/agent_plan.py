"""What the agent profiles of ``kvdiag workload --profile`` send: per-conversation plans drawn from the seed.

An agent conversation is a list of turns. Each turn first changes the history (a task, a user
message, the answers to the previous reply's tool calls, a summary that replaces the history, an
edit, a regeneration) and then asks the model for a reply of a planned shape (reasoning words,
content words, tool calls), through the emulated engines' ``kvdiag_sim`` request hint. Plans are
fixed up front from ``--seed``, so runs repeat exactly and a test can predict every turn.

Profiles (docs/workload.md):

* ``coding-agent``: a tool loop (one call per reply, long tool outputs), 20-50 turns, the prompt
  growing past 32k tokens; now and then the model answers and the user asks for more;
* ``reasoning-chat``: user and assistant turns of a reasoning model (long traces the template drops);
* ``parallel-tools``: replies with 2-4 tool calls at once, answered by consecutive tool messages;
* ``sub-agents``: a coding agent whose tool calls start sub-agents (their own conversation ids,
  the parent's system prompt and task as a shared prefix), run concurrently, whose answers come
  back as the tool results;
* ``compaction``: a coding agent that, past a prompt size, asks for a summary and continues from
  the system prompt and that summary alone;
* ``edits``: a chat with regenerations, an edited last question, an edited reply, an edited
  earlier message (meant for a model without a reasoning parser, where plain replies are reused
  in full).

Usage::

    plans = make_agent_plans(AgentSpec(profile="coding-agent", conversations=2, seed=1))
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError

AGENT_PROFILES: Final = ("coding-agent", "reasoning-chat", "parallel-tools", "sub-agents", "compaction", "edits")
# Profiles meant for a reasoning deployment (P and D with --reasoning-parser); edits is for a plain model.
REASONING_PROFILES: Final = frozenset(AGENT_PROFILES) - {"edits"}

MAX_SUB_AGENTS: Final = 3      # sub-agents per spawning turn
MAX_SPAWNS: Final = 2          # spawning turns per parent conversation
MIN_TURNS: Final = 3
MAX_AGENT_TURNS: Final = 200
MAX_TOOL_TOKENS: Final = 8_000

# The tool schemas every tool-using profile sends (the first parameter is what the model fills).
TOOLS: Final[tuple[dict[str, Any], ...]] = tuple(
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {param: {"type": "string", "description": pdesc}}, "required": [param]}}}
    for name, desc, param, pdesc in (
        ("read_file", "Read a file of the repository.", "path", "path relative to the repository root"),
        ("run_command", "Run a shell command in the repository and return its output.", "command", "the command"),
        ("search_code", "Search the repository for a pattern.", "query", "a regular expression"),
        ("task", "Hand a sub-task to a sub-agent and return its answer.", "description", "what to do"),
    ))


class AgentSpecError(KVDiagError, ValueError):
    """An agent workload option the profiles cannot run with; the message names the option."""


class Step(StrEnum):
    """How a turn changes the history before it asks for a reply (the client log's ``attrs.scenario``)."""

    TASK = "task"                      # the conversation's first user message
    USER = "user"                      # a new user message
    TOOL_RESULTS = "tool_results"      # one tool message per call of the previous reply
    SUB_AGENTS = "sub_agents"          # the previous reply's calls run as sub-agents; their answers are the results
    SUMMARIZE = "summarize"            # ask for a summary of the history (the compaction request)
    COMPACTED = "compacted"            # history replaced by the system prompt and the summary
    REGENERATE = "regenerate"          # the previous prompt sent again (the reply discarded)
    EDIT_LAST_USER = "edit_last_user"  # the previous prompt with its last user message rewritten
    EDIT_REPLY = "edit_reply"          # the previous reply edited by the client, then a new user message
    EDIT_HISTORY = "edit_history"      # an earlier user message edited, then a new user message


@dataclass(frozen=True)
class Reply:
    """The reply asked of the emulated model (the ``kvdiag_sim`` hint)."""

    reasoning_tokens: int | None = None  # None: no trace asked (a reasoning deployment still thinks briefly)
    content_tokens: int = 0
    tool_calls: int = 0
    tool_arg_tokens: int = 6

    def hint(self) -> dict[str, int]:
        """The request hint."""
        out = {"content_tokens": self.content_tokens, "tool_calls": self.tool_calls,
               "tool_arg_tokens": self.tool_arg_tokens}
        if self.reasoning_tokens is not None:
            out["reasoning_tokens"] = self.reasoning_tokens
        return out

    def max_tokens(self) -> int:
        """A ``max_tokens`` the whole reply fits in (tags, JSON and the end token included)."""
        return (self.reasoning_tokens or 0) + self.content_tokens + self.tool_calls * (self.tool_arg_tokens + 40) + 48


@dataclass(frozen=True)
class AgentTurn:
    """One turn: the history change, its sizes, the reply asked, the wait before it."""

    step: Step
    tokens: tuple[int, ...] = ()  # the user message's size, or each tool result's (cycled over the calls)
    reply: Reply = field(default_factory=Reply)
    gap_s: float = 0.0


@dataclass(frozen=True)
class AgentPlan:
    """One conversation of a profile (and the sub-agents its turns start)."""

    conversation_id: str
    profile: str
    turns: tuple[AgentTurn, ...]
    system_tokens: int
    tools: bool = True
    send_id: bool = True
    compact_over: int | None = None  # compaction: summarize once the prompt passes this many tokens
    summary_tokens: int = 0          # compaction: the summary's size
    sub_agents: tuple[tuple[int, tuple[AgentPlan, ...]], ...] = ()  # (turn number, plans) of SUB_AGENTS turns
    task_tokens: int = 200  # sub-agents: the parent's task message they share

    def subagents_at(self, number: int) -> tuple[AgentPlan, ...]:
        """The sub-agent plans that turn ``number`` (1-based) runs."""
        return next((plans for turn, plans in self.sub_agents if turn == number), ())


@dataclass(frozen=True)
class AgentSpec:
    """The options the agent profiles take (``kvdiag workload --profile ...``)."""

    profile: str
    conversations: int = 1
    seed: int = 0
    turns: int = 0           # 0: the profile's own range; else every conversation has this many turns
    scale: float = 1.0       # message and tool-output sizes (and turn ranges) times this
    gap_mean: float = 0.0    # mean wait before a user turn (tool turns wait a tenth)
    prefix: str = "agent"

    def validate(self) -> None:
        """Raise AgentSpecError naming the first bad option."""
        if self.profile not in AGENT_PROFILES:
            raise AgentSpecError(f"--profile {self.profile!r}: expected chat or one of {', '.join(AGENT_PROFILES)}")
        if not 1 <= self.conversations <= 1000:
            raise AgentSpecError(f"--conversations {self.conversations}: agent profiles run 1..1000 conversations")
        if self.turns and not MIN_TURNS <= self.turns <= MAX_AGENT_TURNS:
            raise AgentSpecError(f"--turns {self.turns}: agent profiles need {MIN_TURNS}..{MAX_AGENT_TURNS} "
                                 "(or leave it out for the profile's own range)")
        if not 0.01 <= self.scale <= 4.0:
            raise AgentSpecError(f"--size-scale {self.scale}: use 0.01..4")
        if not 0.0 <= self.gap_mean <= 3600.0:
            raise AgentSpecError(f"--gap-mean {self.gap_mean}: use 0..3600 seconds")


class _Draw:
    """Seeded sizes for one conversation, scaled."""

    def __init__(self, spec: AgentSpec, key: str) -> None:
        self.rng = random.Random(f"{spec.seed}:{spec.profile}:{key}")
        self.spec = spec

    def size(self, lo: int, hi: int) -> int:
        return max(1, round(self.rng.randint(lo, hi) * self.spec.scale))

    def turns(self, lo: int, hi: int) -> int:
        if self.spec.turns:
            return self.spec.turns
        return max(MIN_TURNS, round(self.rng.randint(lo, hi) * min(self.spec.scale, 1.0)))

    def gap(self, tool: bool) -> float:
        mean = self.spec.gap_mean / (10.0 if tool else 1.0)
        return round(min(self.rng.expovariate(1.0 / mean), 10 * mean), 3) if mean > 0 else 0.0

    def reasoning(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


def _tool_reply(d: _Draw, calls: int = 1, think: tuple[int, int] = (10, 60)) -> Reply:
    return Reply(reasoning_tokens=d.reasoning(*think), tool_calls=calls, tool_arg_tokens=d.rng.randint(3, 10))


def _answer(d: _Draw, lo: int = 30, hi: int = 120, think: tuple[int, int] = (10, 60)) -> Reply:
    return Reply(reasoning_tokens=d.reasoning(*think), content_tokens=d.size(lo, hi))


def _coding_turns(d: _Draw, n: int, final_prompt: tuple[int, int], start: int) -> list[AgentTurn]:
    """A tool loop of ``n`` turns whose prompt grows from ``start`` to about ``final_prompt`` tokens."""
    target = d.size(*final_prompt)
    per_turn = max(100, (target - start) // max(n - 1, 1))
    turns = [AgentTurn(Step.TASK, (d.size(150, 400),), _tool_reply(d))]
    for number in range(2, n + 1):
        last = number == n
        previous = turns[-1]
        step = Step.USER if previous.reply.tool_calls == 0 else Step.TOOL_RESULTS
        if step is Step.USER:
            sizes: tuple[int, ...] = (d.size(40, 200),)
        else:
            sizes = tuple(min(MAX_TOOL_TOKENS, max(20, round(per_turn * d.rng.uniform(0.4, 1.6))))
                          for _ in range(previous.reply.tool_calls))
        # Now and then the agent reports back and the user asks for more (a new query for the template).
        reply = _answer(d) if last or d.rng.random() < 0.1 else _tool_reply(d)
        turns.append(AgentTurn(step, sizes, reply, d.gap(tool=step is Step.TOOL_RESULTS)))
    return turns


def _coding_agent(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    system = d.size(800, 1600)
    return AgentPlan(cid, spec.profile, tuple(_coding_turns(d, d.turns(20, 50), (34_000, 40_000), system)), system)


def _reasoning_chat(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    n = d.turns(6, 12)
    turns = [AgentTurn(Step.TASK if i == 0 else Step.USER, (d.size(60, 400),),
                       _answer(d, 60, 200, think=(40, 200)), d.gap(tool=False) if i else 0.0) for i in range(n)]
    return AgentPlan(cid, spec.profile, tuple(turns), d.size(100, 300), tools=False)


def _parallel_tools(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    n = d.turns(8, 16)
    turns = [AgentTurn(Step.TASK, (d.size(150, 400),), _tool_reply(d, d.rng.randint(2, 4), think=(10, 40)))]
    for number in range(2, n + 1):
        previous = turns[-1].reply
        step = Step.TOOL_RESULTS if previous.tool_calls else Step.USER
        sizes = tuple(d.size(150, 800) for _ in range(max(previous.tool_calls, 1)))
        reply = (_answer(d) if number == n or d.rng.random() < 0.1
                 else _tool_reply(d, d.rng.randint(2, 4), think=(10, 40)))
        turns.append(AgentTurn(step, sizes, reply, d.gap(tool=step is Step.TOOL_RESULTS)))
    return AgentPlan(cid, spec.profile, tuple(turns), d.size(600, 1200))


def _sub_agents(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    system = d.size(800, 1600)
    n = d.turns(6, 10)
    turns = _coding_turns(d, n, (8_000, 14_000), system)
    spawns: list[tuple[int, tuple[AgentPlan, ...]]] = []
    # Turns 3 and later (not the last) whose previous reply made calls: some become sub-agent runs.
    candidates = [i for i in range(2, n - 1) if turns[i - 1].reply.tool_calls]
    for i in sorted(d.rng.sample(candidates, min(MAX_SPAWNS, len(candidates)))):
        count = d.rng.randint(2, MAX_SUB_AGENTS)
        turns[i - 1] = AgentTurn(turns[i - 1].step, turns[i - 1].tokens, _tool_reply(d, count), turns[i - 1].gap_s)
        subs = []
        for j in range(count):
            sd = _Draw(spec, f"{cid}:sub{i + 1}:{j}")
            sub_turns = _coding_turns(sd, sd.turns(3, 6), (3_000, 6_000), system)
            subs.append(AgentPlan(f"{cid}-sub{i + 1}-{j}", spec.profile, tuple(sub_turns), system))
        turns[i] = AgentTurn(Step.SUB_AGENTS, (), turns[i].reply, turns[i].gap_s)
        spawns.append((i + 1, tuple(subs)))
    return AgentPlan(cid, spec.profile, tuple(turns), system, sub_agents=tuple(spawns),
                     task_tokens=turns[0].tokens[0])


def _compaction(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    system = d.size(800, 1600)
    n = d.turns(15, 30)
    turns = _coding_turns(d, n, (24_000, 30_000), system)
    return AgentPlan(cid, spec.profile, tuple(turns), system, compact_over=max(512, round(10_000 * spec.scale)),
                     summary_tokens=d.size(600, 900))


_EDIT_STEPS: Final = (Step.REGENERATE, Step.EDIT_LAST_USER, Step.EDIT_REPLY, Step.EDIT_HISTORY)


def _edits(d: _Draw, spec: AgentSpec, cid: str) -> AgentPlan:
    n = d.turns(8, 14)
    # Every kind of edit once (where the turns allow), at seeded turns after the second; a few more at random.
    later = list(range(3, n + 1))
    kinds = list(_EDIT_STEPS)
    d.rng.shuffle(kinds)
    at = dict(zip(sorted(d.rng.sample(later, min(len(kinds), len(later)))), kinds, strict=False))
    turns = [AgentTurn(Step.TASK, (d.size(60, 300),), Reply(content_tokens=d.size(40, 200)))]
    for number in range(2, n + 1):
        step = at.get(number, Step.USER)
        if step is Step.USER and number > 2 and d.rng.random() < 0.2:
            step = _EDIT_STEPS[d.rng.randrange(len(_EDIT_STEPS))]
        turns.append(AgentTurn(step, (d.size(60, 300),), Reply(content_tokens=d.size(40, 200)), d.gap(tool=False)))
    return AgentPlan(cid, spec.profile, tuple(turns), d.size(100, 300), tools=False)


_BUILDERS: Final = {"coding-agent": _coding_agent, "reasoning-chat": _reasoning_chat,
                    "parallel-tools": _parallel_tools, "sub-agents": _sub_agents, "compaction": _compaction,
                    "edits": _edits}


def make_agent_plans(spec: AgentSpec) -> list[AgentPlan]:
    """Every conversation's plan, drawn from ``spec.seed``."""
    spec.validate()
    plans = []
    for index in range(spec.conversations):
        cid = f"{spec.prefix}-{spec.profile}-{spec.seed}-{index:03d}"
        plans.append(_BUILDERS[spec.profile](_Draw(spec, str(index)), spec, cid))
    return plans


def count_turns(plans: list[AgentPlan]) -> int:
    """Requests the plans send, sub-agents included."""
    return sum(len(p.turns) + sum(count_turns(list(subs)) for _, subs in p.sub_agents) for p in plans)
