"""What the multi-turn agent client will send: configuration, per-conversation plans, synthetic text.

A plan is decided up front from ``--seed`` so a run is reproducible and a test can predict which
turn carries which scenario (docs/design.md Contract 4 maps each scenario to the verdict it yields).

Usage::

    config = WorkloadConfig(url="http://127.0.0.1:8000", conversations=4, turns=3, regenerate_share=0.2)
    plans = make_plans(config)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from kvdiag.schema.errors import KVDiagError
from kvdiag.sim.tokenizer import vocab_words

GAP_DISTRIBUTIONS: Final = ("exp", "uniform", "fixed")

# Bounds that keep one run finite whatever the options say.
MAX_CONVERSATIONS: Final = 10_000
MAX_TURNS: Final = 500
MAX_NEW_TOKENS: Final = 32_768
MAX_REPLY_TOKENS: Final = 8_192
MAX_GAP_S: Final = 3_600.0


class WorkloadConfigError(KVDiagError, ValueError):
    """An option value the workload cannot run with; the message names the option and the fix."""


class Scenario(StrEnum):
    """What a turn does besides appending a message; the value is the client log's ``attrs.scenario``."""

    NORMAL = "normal"
    REGENERATE = "regenerate"  # re-send the previous turn's prompt: P's own cache holds it (local_hit)
    DUPLICATE = "duplicate"  # a second copy of the turn while the first is in flight (concurrent_turn)
    EDIT = "edit"  # rewrite the history first: the first message edited, replies stripped (prefix_mismatch)
    DISCONNECT = "disconnect"  # drop the stream after the first token (next turn: metadata_not_returned)


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of one workload run (the ``kvdiag workload`` options)."""

    url: str
    model: str = "Qwen/Qwen3-32B"  # the sim's default served model name
    conversations: int = 4
    turns: int = 4
    concurrency: int = 4
    stream: bool = True
    send_conversation_id: bool = True
    no_id_share: float = 0.0
    gap_mean: float = 0.2
    gap_dist: str = "exp"
    long_gap_share: float = 0.0
    long_gap: float = 0.0
    new_tokens: int = 48
    max_tokens: int = 16
    tool_share: float = 0.5
    regenerate_share: float = 0.0
    duplicate_share: float = 0.0
    edit_share: float = 0.0
    disconnect_share: float = 0.0
    seed: int = 0
    duration_limit: float = 300.0
    request_timeout: float = 60.0
    conversation_prefix: str = "conv"

    def validate(self) -> None:
        """Raise WorkloadConfigError naming the first bad option."""
        if not self.url.startswith(("http://", "https://")):
            raise WorkloadConfigError(f"--url {self.url!r} must start with http:// or https://")
        _check_range("--conversations", self.conversations, 1, MAX_CONVERSATIONS)
        _check_range("--turns", self.turns, 1, MAX_TURNS)
        _check_range("--concurrency", self.concurrency, 1, 1024)
        _check_range("--new-tokens", self.new_tokens, 1, MAX_NEW_TOKENS)
        _check_range("--max-tokens", self.max_tokens, 1, MAX_REPLY_TOKENS)
        for name, share in (("--no-id-share", self.no_id_share), ("--long-gap-share", self.long_gap_share),
                            ("--tool-share", self.tool_share), ("--regenerate-share", self.regenerate_share),
                            ("--duplicate-share", self.duplicate_share), ("--edit-share", self.edit_share),
                            ("--disconnect-share", self.disconnect_share)):
            if not 0.0 <= share <= 1.0:
                raise WorkloadConfigError(f"{name} {share} must be a fraction between 0 and 1")
        scenario_total = self.regenerate_share + self.duplicate_share + self.edit_share + self.disconnect_share
        if scenario_total > 1.0:
            raise WorkloadConfigError(
                f"the scenario shares add up to {scenario_total:.2f}; keep --regenerate/--duplicate/--edit/"
                "--disconnect-share at a total of 1 or less")
        if self.gap_dist not in GAP_DISTRIBUTIONS:
            raise WorkloadConfigError(f"--gap-dist {self.gap_dist!r}: expected one of {', '.join(GAP_DISTRIBUTIONS)}")
        for name, value in (("--gap-mean", self.gap_mean), ("--long-gap", self.long_gap)):
            if not 0.0 <= value <= MAX_GAP_S:
                raise WorkloadConfigError(f"{name} {value} must be between 0 and {MAX_GAP_S:.0f} seconds")
        if self.long_gap_share > 0 and self.long_gap <= 0:
            raise WorkloadConfigError("--long-gap-share needs --long-gap SECONDS (e.g. beyond the router TTL)")
        if self.disconnect_share > 0 and not self.stream:
            raise WorkloadConfigError("--disconnect-share needs --stream (the client drops a stream mid-reply)")
        for name, value in (("--duration-limit", self.duration_limit), ("--request-timeout", self.request_timeout)):
            if value <= 0:
                raise WorkloadConfigError(f"{name} must be positive, got {value}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise WorkloadConfigError(f"{name} {value} is out of range; use {low}..{high}")


@dataclass(frozen=True)
class TurnPlan:
    """One turn: how long to wait after the previous reply, and what to do."""

    gap_s: float = 0.0
    scenario: Scenario = Scenario.NORMAL
    long_gap: bool = False
    tool_result: bool = False


@dataclass(frozen=True)
class ConversationPlan:
    """One conversation: its id, whether the id is sent, and its turns (turn 1 first)."""

    conversation_id: str
    turns: tuple[TurnPlan, ...]
    send_id: bool = True
    max_tokens: int | None = None  # None: the config's --max-tokens
    new_tokens: int | None = None  # None: the config's --new-tokens
    tags: dict[str, str] = field(default_factory=dict)  # extra attrs for every turn's client record


def sample_gap(rng: random.Random, dist: str, mean: float) -> float:
    """One inter-turn gap in seconds from the named distribution."""
    if mean <= 0:
        return 0.0
    if dist == "exp":
        return min(rng.expovariate(1.0 / mean), 10 * mean)  # cap the tail so a run stays bounded
    if dist == "uniform":
        return rng.uniform(0.0, 2.0 * mean)
    return mean


def _pick_scenario(rng: random.Random, config: WorkloadConfig, turn: int) -> Scenario:
    if turn == 1:
        return Scenario.NORMAL  # every scenario needs an earlier answered turn
    draw = rng.random()
    for scenario, share in ((Scenario.REGENERATE, config.regenerate_share),
                            (Scenario.DUPLICATE, config.duplicate_share),
                            (Scenario.EDIT, config.edit_share),
                            (Scenario.DISCONNECT, config.disconnect_share)):
        if draw < share:
            return scenario
        draw -= share
    return Scenario.NORMAL


def make_plans(config: WorkloadConfig) -> list[ConversationPlan]:
    """Draw every conversation's plan from ``config.seed``."""
    config.validate()
    rng = random.Random(config.seed)
    plans: list[ConversationPlan] = []
    for index in range(config.conversations):
        send_id = config.send_conversation_id and rng.random() >= config.no_id_share
        turns: list[TurnPlan] = []
        for turn in range(1, config.turns + 1):
            long_gap = turn > 1 and rng.random() < config.long_gap_share
            gap = 0.0
            if turn > 1:
                gap = config.long_gap if long_gap else sample_gap(rng, config.gap_dist, config.gap_mean)
            turns.append(TurnPlan(gap_s=round(gap, 3), scenario=_pick_scenario(rng, config, turn),
                                  long_gap=long_gap, tool_result=turn > 1 and rng.random() < config.tool_share))
        plans.append(ConversationPlan(conversation_id=f"{config.conversation_prefix}-{config.seed}-{index:04d}",
                                      turns=tuple(turns), send_id=send_id))
    return plans


def synthetic_text(rng: random.Random, tokens: int, *, prefix: str = "") -> str:
    """``tokens`` in-vocabulary words (one sim token each), after ``prefix``."""
    words = vocab_words()
    text = " ".join(rng.choice(words) for _ in range(max(tokens, 1)))
    return f"{prefix} {text}" if prefix else text
