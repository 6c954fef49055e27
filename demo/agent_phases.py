"""The demo's agent traffic: every agent profile, and two long conversations that show the article's effect.

It runs against a second testbed shaped like the article's deployment and like an agent
deployment: P with prefix caching off (every reused token is a D->P read), P and D with vLLM's
``qwen3`` reasoning parser and ``hermes`` tool parser, the ``qwen3-32b`` time model at
:data:`AGENT_TIME_SCALE`. Two groups of conversations run concurrently with the verdict phases:

* the agent scenarios: one small conversation per profile of ``kvdiag workload``
  (:mod:`kvdiag.sim.agent_plan`), with the client variants that hide the reasoning or switch
  thinking off, so the router trims replies for every reason it has;
* the article pair: the same long tool-loop conversation twice, growing from about 2k to 24k
  prompt tokens, once with a conversation id (D's KV reused) and once without (P recomputes
  every turn), so each turn's TTFT can be compared at the same prompt length.

Usage::

    await run_agent_phases(runner_for, log)   # runner_for(options) -> AgentRunner on the agent router
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvdiag.sim.agent_client import AgentConversation, AgentOptions, AgentRunner
from kvdiag.sim.agent_plan import TOOLS, AgentPlan, AgentSpec, AgentTurn, Reply, Step, make_agent_plans
from kvdiag.sim.tokenizer import render_chat
from kvdiag.sim.workload_plan import synthetic_text

# The agent testbed's engines sleep the modelled time itself: its longest conversation takes about
# 11 s, inside the demo's minute, and the sims' own CPU time on 24k-token prompts stays inside the
# modelled sleeps, so the measured TTFT follows the model as well (at 0.5 it visibly did not on a
# loaded machine). The article check reads the modelled figures, which do not depend on this.
AGENT_TIME_SCALE: Final = 1.0
AGENT_PROFILE: Final = "qwen3-32b"
ARTICLE_REUSE_ID: Final = "demo-article-reuse"
ARTICLE_RECOMPUTE_ID: Final = "demo-article-recompute"
# Prompt tokens per turn of the article pair. The 2k turn adds a short tool output (about 10% of
# its prompt); from there every turn adds 28% of its prompt (the time model's calibration share)
# up to the article's 24k row.
ARTICLE_PROMPTS: Final = (1_843, 2_048, 2_465, 3_424, 4_755, 6_605, 9_173, 12_740, 17_695, 24_576)
ARTICLE_ROWS: Final = ((2_048, 158.0, 122.0), (24_576, 778.0, 460.0))  # (prompt, TTFT off ms, on ms), Qwen3-32B
_ARTICLE_REPLY: Final = Reply(reasoning_tokens=8, tool_calls=1, tool_arg_tokens=4)
_REPLY_AND_WRAPPERS: Final = 46  # the reply as history plus the tool turn's template tokens (measured)
_ARTICLE_SYSTEM: Final = 900


@dataclass(frozen=True)
class AgentScenario:
    """One demo conversation of an agent profile and how its client behaves."""

    name: str
    spec: AgentSpec
    options: AgentOptions
    produces: str  # what the summary says it shows


def agent_scenarios(seed: int = 0) -> list[AgentScenario]:
    """One small conversation per agent profile (sizes scaled down, turns fixed)."""
    def spec(profile: str, turns: int, scale: float) -> AgentSpec:
        return AgentSpec(profile=profile, conversations=1, seed=seed, turns=turns, scale=scale, prefix="demo-agent")

    return [
        AgentScenario("coding-agent", spec("coding-agent", 5, 0.08), AgentOptions(),
                      "reasoning then a tool call; the trace is dropped from history"),
        AgentScenario("reasoning-chat (hidden)", spec("reasoning-chat", 3, 0.4), AgentOptions(hide_reasoning=True),
                      "include_reasoning: false"),
        AgentScenario("parallel-tools (no thinking)", spec("parallel-tools", 3, 0.3), AgentOptions(thinking=False),
                      "several tool calls, re-rendered by the template"),
        AgentScenario("sub-agents", spec("sub-agents", 4, 0.1), AgentOptions(),
                      "sub-agents under their own ids, from a shared prefix"),
        AgentScenario("compaction", spec("compaction", 6, 0.1), AgentOptions(),
                      "history replaced by a summary past a size"),
        AgentScenario("edits", spec("edits", 5, 0.3), AgentOptions(), "regenerations and edited messages"),
    ]


def article_plan(conversation_id: str, *, send_id: bool) -> AgentPlan:
    """The long tool loop of the article pair, sized to :data:`ARTICLE_PROMPTS`."""
    system = {"role": "system", "content": synthetic_text(random.Random(0), _ARTICLE_SYSTEM)}
    base = len(render_chat([system, {"role": "user", "content": "x"}], tools=list(TOOLS))) - 1
    turns = [AgentTurn(Step.TASK, (ARTICLE_PROMPTS[0] - base,), _ARTICLE_REPLY)]
    for before, after in itertools.pairwise(ARTICLE_PROMPTS):
        turns.append(AgentTurn(Step.TOOL_RESULTS, (after - before - _REPLY_AND_WRAPPERS,), _ARTICLE_REPLY))
    return AgentPlan(conversation_id, "article", tuple(turns), _ARTICLE_SYSTEM, send_id=send_id)


async def run_agent_phases(runner_for: Callable[[AgentOptions], AgentRunner]) -> list[AgentConversation]:
    """Run the agent scenarios and the article pair concurrently; return every top-level conversation."""
    convs: list[tuple[AgentRunner, AgentConversation]] = []
    for i, scenario in enumerate(agent_scenarios()):
        runner = runner_for(scenario.options)
        for plan in make_agent_plans(scenario.spec):
            convs.append((runner, runner.new_conversation(plan, 200 + i)))
    plain = runner_for(AgentOptions())
    for j, (cid, send_id) in enumerate(((ARTICLE_REUSE_ID, True), (ARTICLE_RECOMPUTE_ID, False))):
        plan = article_plan(cid, send_id=send_id)
        # Same sizes, different text: D's prefix cache must not serve one conversation from the other.
        conv = plain.new_conversation(plan, 300 + j)
        conv.system_text = synthetic_text(conv.rng, _ARTICLE_SYSTEM)
        convs.append((plain, conv))
    await asyncio.gather(*(runner.run_conversation(conv) for runner, conv in convs))
    return [conv for _, conv in convs]
