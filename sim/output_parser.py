"""vLLM 0.33's output parsing for the sim's replies: the ``qwen3`` reasoning parser and the ``hermes`` tool parser.

What a client sees of a reply depends on the server's parsers, not on what the model wrote:

* no reasoning parser: the trace stays in ``content``, tags and all;
* ``--reasoning-parser qwen3`` (thinking enabled): ``<think>`` and ``</think>`` vanish, the text
  between them streams as ``reasoning`` deltas (leading and trailing newline included) and
  becomes ``message.reasoning``; what follows ``</think>`` (``\\n\\n`` included) is content. A
  reply without ``</think>`` is all reasoning. ``include_reasoning: false`` drops the trace (the
  model still generated it) and sets ``reasoning: null`` on every other delta;
* ``--tool-call-parser hermes`` with tool calls kept: content before the first ``<tool_call>``
  streams as content; for each call a delta with ``id`` (``chatcmpl-tool-<16 hex>``), ``type``,
  ``index`` and the function ``name`` once the name is complete, then the *model's own* argument
  text in fragments (the outer object's closing brace held back); the full response carries
  ``arguments`` as ``json.dumps`` of the parsed object instead. ``parallel_tool_calls: false``
  keeps only call 0 (the stream still sends ``{"content": null}`` chunks for the others).

Usage::

    parser = StreamParser(setup)
    for tok in output_ids:
        delta = parser.step(tok)        # a DeltaMessage dict, or None when nothing is sendable yet
    message = parse_full(setup, output_ids)
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.sim.tokenizer import IM_END, THINK_END, THINK_START, TOOL_CALL_START, detokenize, token_text

TOOL_START: Final = "<tool_call>"
TOOL_END: Final = "</tool_call>"
_NAME_RE: Final = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS_RE: Final = re.compile(r'"arguments"\s*:\s*')
_CALL_RE: Final = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ParserSetup:
    """Which parsers run for one request, and the request options they honour."""

    reasoning: bool = False  # --reasoning-parser qwen3
    thinking: bool = True  # chat_template_kwargs.enable_thinking is not false
    tools: bool = False  # the tool parser runs and the request keeps tool calls
    include_reasoning: bool = True
    parallel: bool | None = None  # parallel_tool_calls
    reasoning_field: str = "reasoning"  # vLLM 0.33's name; older releases used reasoning_content
    configured: bool = False  # the server has a reasoning or a tool parser (whatever the request asks)

    @property
    def active(self) -> bool:
        """True when vLLM runs a parser for the request: the final chunk is then ``{}`` rather than
        ``{"content": ""}``, and ``include_reasoning: false`` also hides the token ids."""
        return self.configured or self.reasoning or self.tools


def new_tool_call_id() -> str:
    """vLLM's random tool-call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def _overlap(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _complete(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call_regions(text: str) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    pos = 0
    while (start := text.find(TOOL_START, pos)) >= 0:
        body_start = start + len(TOOL_START)
        end = text.find(TOOL_END, body_start)
        if end >= 0:
            out.append((text[body_start:end].strip(), True))
            pos = end + len(TOOL_END)
            continue
        raw = text[body_start:]
        cut = _overlap(raw, TOOL_END)
        body = (raw[:-cut] if cut else raw).strip()
        # only an object can be a complete call body: skip the parse until the text could close one
        out.append((body, body.endswith("}") and _complete(body)))
        break
    return out


def _arguments_text(body: str, complete: bool) -> str | None:
    match = _ARGS_RE.search(body)
    if match is None:
        return None
    raw = body[match.end():]
    if complete:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


@dataclass
class StreamParser:
    """Turns output tokens into the deltas vLLM would stream, one token at a time."""

    setup: ParserSetup
    in_reasoning: bool = field(init=False)
    tools_streamed: bool = False
    _text: str = ""  # what the tool parser has seen (content after the trace)
    _sent: int = 0
    _names: list[str | None] = field(default_factory=list)
    _args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.in_reasoning = self.setup.reasoning and self.setup.thinking

    def _with_reasoning_null(self, delta: dict[str, Any]) -> dict[str, Any]:
        if self.setup.reasoning and not self.setup.include_reasoning:
            out: dict[str, Any] = {"content": delta.get("content")}
            out[self.setup.reasoning_field] = None
            out.update((k, v) for k, v in delta.items() if k != "content")
            return out
        return delta

    def step(self, tok: int) -> dict[str, Any] | None:
        """The delta for one more output token, or None (nothing sendable)."""
        if tok == IM_END:
            return None  # end of sequence: not part of the text
        if self.setup.reasoning:
            if self.in_reasoning:
                if tok == THINK_START:
                    return None
                if tok == THINK_END:
                    self.in_reasoning = False
                    return None
                if not (tok == TOOL_CALL_START and self.setup.tools):
                    if not self.setup.include_reasoning:
                        return None
                    return {self.setup.reasoning_field: token_text(tok)}
                self.in_reasoning = False
            elif tok == THINK_END:
                return None
        text = token_text(tok)
        if not self.setup.tools:
            return self._with_reasoning_null({"content": text})
        return self._tool_step(text)

    def _tool_step(self, piece: str) -> dict[str, Any] | None:
        self._text += piece
        text = self._text
        sendable = text.index(TOOL_START) if TOOL_START in text else len(text) - _overlap(text, TOOL_START)
        content: str | None = None
        if sendable > self._sent:
            content, self._sent = text[self._sent:sendable], sendable
        calls: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(_call_regions(text)):
            if i >= len(self._names):
                self._names.append(None)
                self._args.append("")
            if self._names[i] is None:
                match = _NAME_RE.search(body)
                if match is None:
                    break
                self._names[i] = match.group(1)
                calls.append({"id": new_tool_call_id(), "type": "function", "index": i,
                              "function": {"name": match.group(1)}})
            args = _arguments_text(body, complete)
            if args is not None and len(args) > len(self._args[i]):
                calls.append({"index": i, "function": {"arguments": args[len(self._args[i]):]}})
                self._args[i] = args
        if not content and not calls:
            return None
        if calls:
            self.tools_streamed = True
            if self.setup.parallel is False:
                calls = [c for c in calls if c["index"] == 0]
        delta: dict[str, Any] = {"content": content}
        if calls:
            delta["tool_calls"] = calls
        return self._with_reasoning_null(delta)


@dataclass(frozen=True)
class ParsedMessage:
    """The non-streaming view of a reply."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_tokens: int


def count_reasoning_tokens(ids: Sequence[int]) -> int:
    """Tokens of the trace, up to ``</think>`` or a tool call (usage.completion_tokens_details.reasoning_tokens)."""
    end = next((i for i, t in enumerate(ids) if t in (THINK_END, TOOL_CALL_START)), len(ids))
    return sum(1 for t in ids[:end] if t not in (THINK_START, IM_END))


def parse_full(setup: ParserSetup, ids: Sequence[int]) -> ParsedMessage:
    """Reasoning, content and tool calls of a finished reply, as vLLM's full (non-streaming) response has them."""
    text = detokenize(t for t in ids if t != IM_END)
    reasoning: str | None = None
    content: str | None = text
    reasoning_tokens = 0
    if setup.reasoning and setup.thinking:
        reasoning_tokens = count_reasoning_tokens(ids)
        end = text.find("</think>")
        call = text.find(TOOL_START) if setup.tools else -1
        if end >= 0 and (call < 0 or end < call):
            head, tail = text[:end], text[end + len("</think>"):]
            reasoning, content = head.split("<think>")[-1], tail or None
        elif call >= 0:  # a tool call ends the trace implicitly
            reasoning, content = text[:call].split("<think>")[-1] or None, text[call:]
        else:
            reasoning, content = text.split("<think>")[-1], None
    calls: list[dict[str, Any]] = []
    if setup.tools and content is not None and TOOL_START in content:
        try:
            parsed = [json.loads(m[0] if m[0] else m[1]) for m in _CALL_RE.findall(content)]
            calls = [{"id": new_tool_call_id(), "type": "function",
                      "function": {"name": p["name"], "arguments": json.dumps(p["arguments"], ensure_ascii=False)}}
                     for p in parsed]
        except (ValueError, KeyError, TypeError):
            calls = []
        if calls:
            content = content[:content.find(TOOL_START)] or None
            if content is not None and not content.strip():
                content = None
    if setup.parallel is False:
        calls = calls[:1]
    if not setup.include_reasoning:
        reasoning = None
    return ParsedMessage(reasoning, content, calls, reasoning_tokens)
