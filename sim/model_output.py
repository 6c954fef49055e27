"""What the emulated model writes for one request: plain words, or a reasoning trace, content and tool calls.

Without a hint and with reasoning off the model writes ``max_tokens`` vocabulary words and stops
on the length limit (the sim's original behaviour). A reasoning model (``--reasoning-tokens N``,
or the request hint) writes Qwen3's shape instead::

    <think>\\n{N words}\\n</think>\\n\\n{content words}[\\n<tool_call>\\n{...}\\n</tool_call> ...]<|im_end|>

unless ``chat_template_kwargs.enable_thinking`` is false (the prompt then already ends with an
empty think block and the model answers directly). Tool calls come in the model's own format:
compact JSON ``{"name":"f","arguments":{"k":"v"}}`` by default, so the template's re-rendering
(``{"name": "f", "arguments": {"k": "v"}}``) differs from what the model generated; the
``template`` style writes exactly what the template renders. A structured reply ends with the
end-of-sequence token (finish ``stop``) when it fits in ``max_tokens``, else it is cut there
(finish ``length``). Everything is deterministic from the seed, the prompt and the hint.

The request hint (``"kvdiag_sim": {...}`` in the body; vLLM ignores unknown fields) sets, per
request: ``reasoning_tokens`` (think for that many words; 0 = an empty trace),
``content_tokens`` (visible words; default: fill ``max_tokens``, or 0 before tool calls),
``tool_calls`` (how many calls to make; needs ``tools`` and a tool choice other than ``none``),
``tool_arg_tokens`` (words in each call's argument, default 8) and ``tool_call_style``
(``compact`` or ``template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError
from kvdiag.sim.chat_template import think_block, tool_call_text
from kvdiag.sim.tokenizer import IM_END, generate_reply, random_words, reply_rng, tokenize

HINT_KEY: Final = "kvdiag_sim"
TOOL_CALL_STYLES: Final = ("compact", "template")
_HINT_INTS: Final = ("reasoning_tokens", "content_tokens", "tool_calls", "tool_arg_tokens")
_MAX_HINT: Final = {"reasoning_tokens": 100_000, "content_tokens": 100_000, "tool_calls": 64,
                    "tool_arg_tokens": 100_000}
DEFAULT_TOOL_ARG_TOKENS: Final = 8


class HintError(KVDiagError, ValueError):
    """A malformed ``kvdiag_sim`` request hint (HTTP 400 naming the field)."""


@dataclass(frozen=True)
class SimHint:
    """The per-request ``kvdiag_sim`` hint; None fields fall back to the engine's configuration."""

    reasoning_tokens: int | None = None
    content_tokens: int | None = None
    tool_calls: int | None = None
    tool_arg_tokens: int | None = None
    tool_call_style: str | None = None

    @classmethod
    def parse(cls, raw: Any) -> SimHint:
        """Validate the hint object of a request body (client-supplied)."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise HintError(f"'{HINT_KEY}' must be an object")
        known = (*_HINT_INTS, "tool_call_style")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise HintError(f"'{HINT_KEY}' has unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        values: dict[str, Any] = {}
        for key in _HINT_INTS:
            value = raw.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_HINT[key]:
                raise HintError(f"'{HINT_KEY}.{key}' must be an integer between 0 and {_MAX_HINT[key]}")
            values[key] = value
        style = raw.get("tool_call_style")
        if style is not None and style not in TOOL_CALL_STYLES:
            raise HintError(f"'{HINT_KEY}.tool_call_style' must be one of {', '.join(TOOL_CALL_STYLES)}")
        return cls(tool_call_style=style, **values)


@dataclass(frozen=True)
class ToolUse:
    """One call the model makes: the function and the argument it fills."""

    name: str
    argument: str


@dataclass(frozen=True)
class OutputPlan:
    """The shape of one reply."""

    think: bool = False
    reasoning_tokens: int = 0
    content_tokens: int | None = None
    calls: tuple[ToolUse, ...] = ()
    tool_arg_tokens: int = DEFAULT_TOOL_ARG_TOKENS
    tool_call_style: str = "compact"

    @property
    def structured(self) -> bool:
        """False for the plain-words reply (no trace, no calls, no content size)."""
        return self.think or bool(self.calls) or self.content_tokens is not None


@dataclass(frozen=True)
class ToolRequest:
    """The tool-related fields of a chat request, validated."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool | None = None


def _tool_uses(tools: ToolRequest, count: int) -> tuple[ToolUse, ...]:
    specs: list[ToolUse] = []
    for tool in tools.tools:
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else {}
        assert isinstance(function, Mapping)
        params = function.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        argument = next(iter(props), "input") if isinstance(props, Mapping) and props else "input"
        specs.append(ToolUse(str(function.get("name", "")), str(argument)))
    if not specs:
        return ()
    if tools.named is not None:
        named = next((s for s in specs if s.name == tools.named), ToolUse(tools.named, "input"))
        return (named,) * count
    return tuple(specs[j % len(specs)] for j in range(count))


def make_plan(hint: SimHint, tools: ToolRequest, *, thinking_enabled: bool, default_reasoning: int | None,
              default_style: str) -> OutputPlan:
    """The reply shape for a request: the hint over the engine's defaults, within what the request allows."""
    reasoning = hint.reasoning_tokens if hint.reasoning_tokens is not None else default_reasoning
    count = 0
    if tools.tools and tools.choice != "none":
        count = hint.tool_calls or 0
        if tools.choice in ("required", "named"):
            count = max(count, 1)
    return OutputPlan(think=reasoning is not None and thinking_enabled, reasoning_tokens=reasoning or 0,
                      content_tokens=hint.content_tokens, calls=_tool_uses(tools, count),
                      tool_arg_tokens=(hint.tool_arg_tokens if hint.tool_arg_tokens is not None
                                       else DEFAULT_TOOL_ARG_TOKENS),
                      tool_call_style=hint.tool_call_style or default_style)


def _call_text(use: ToolUse, value: str, style: str) -> str:
    if style == "template":
        return tool_call_text(use.name, {use.argument: value})
    body = json.dumps({"name": use.name, "arguments": {use.argument: value}}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"<tool_call>\n{body}\n</tool_call>"


def _structured(seed: int, prompt: Sequence[int], plan: OutputPlan, content_n: int) -> list[int]:
    rng = reply_rng(seed, prompt)
    text = think_block(random_words(rng, plan.reasoning_tokens)) if plan.think else ""
    content = random_words(rng, content_n)
    text += content
    for j, use in enumerate(plan.calls):
        if j > 0 or content:
            text += "\n"
        text += _call_text(use, random_words(rng, plan.tool_arg_tokens), plan.tool_call_style)
    return [*tokenize(text), IM_END]


def generate(seed: int, prompt: Sequence[int], max_tokens: int, plan: OutputPlan) -> tuple[list[int], str]:
    """The reply's token ids and its engine finish reason (``stop`` at end-of-sequence, else ``length``)."""
    if not plan.structured:
        return generate_reply(seed, prompt, max_tokens), "length"
    if plan.content_tokens is not None or plan.calls:
        ids = _structured(seed, prompt, plan, plan.content_tokens or 0)
    else:  # content fills max_tokens exactly (the trace's closing newlines tokenize with the first word)
        ids = _structured(seed, prompt, plan, 1)
        ids = _structured(seed, prompt, plan, max(1, 1 + max_tokens - len(ids)))
    if len(ids) > max_tokens:
        return ids[:max_tokens], "length"
    return ids, "stop"
