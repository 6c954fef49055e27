"""Which of D's tokens the next prompt is shown to reproduce: the rule behind every injected handle.

D's handle covers D's whole sequence, the turn's prompt plus the reply D generated, and P reads it
positionally without checking its own tokens. This module decides, from what the router recorded
about the previous turn (:class:`Coverage`) and the new request (:class:`PromptView`), how much of
the handle may be injected (:func:`decide`), and cuts the handle to that many tokens
(:func:`trim_handle`). It does no I/O: the flow records, stores and injects.

Usage::

    view = prompt_view(body, coverage.lengths())       # None: a request shape the rule cannot check
    decision = decide(coverage, view, handle_tokens=params["remote_num_tokens"], block_size=16, margin=8)
    if decision.reuse is Reuse.TRIMMED:
        params = trim_handle(params, decision.limit_tokens, 16)
    rungs = next_rungs(coverage, decision, view, usage["prompt_tokens"])  # stored with D's next handle
"""

from __future__ import annotations

import array
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from kvdiag.schema.verdicts import TrimReason

CHAT: Final = "messages"
COMPLETION: Final = "prompt"
MAX_RUNGS: Final = 16          # turn boundaries kept with a handle (the newest ones)
MAX_CHECKPOINTS: Final = 256   # token-trace checkpoints kept with a handle (2 KiB)
DIGEST_HEX: Final = 32         # sha256 hex digits kept per rung (128 bits)
DEFAULT_MARGIN: Final = 8      # generation-prompt tokens a history rendering may not reproduce

# Tags a reasoning model writes around its trace when no reasoning parser extracts it; chat
# templates split content at them when the message comes back as history.
THINK_TAGS: Final = ("<think>", "</think>", "<thinking>", "</thinking>", "[THINK]", "[/THINK]",
                     "<seed:think>", "</seed:think>", "<|channel|>")
REASONING_KEYS: Final = ("reasoning", "reasoning_content", "thinking")

# Request fields that change how the template renders the *whole* prompt (system prompt, tool
# schemas, template variables): a rung only matches a prompt rendered with the same ones.
RENDER_FIELDS: Final = ("model", "tools", "tool_choice", "chat_template", "chat_template_kwargs", "documents",
                        "reasoning_effort", "response_format", "add_special_tokens", "mm_processor_kwargs",
                        "media_io_kwargs")
COMPLETION_RENDER_FIELDS: Final = ("model", "add_special_tokens")


class Reuse(StrEnum):
    """What the router injects: D's whole handle, a handle cut to the proven tokens, or nothing."""

    FULL = "full"
    TRIMMED = "trimmed"
    NONE = "none"


class Part(StrEnum):
    """A non-content part of D's reply (the client cannot send it back as plain content)."""

    REASONING = "reasoning"                  # vLLM >= 0.11 reasoning deltas / message field
    REASONING_CONTENT = "reasoning_content"  # older servers
    TOOL_CALLS = "tool_calls"
    FUNCTION_CALL = "function_call"
    REFUSAL = "refusal"
    THINK_TAG = "think_tag"                  # a reasoning tag inside the content text
    OTHER = "other"                          # any other non-empty non-content field


class Option(StrEnum):
    """A request option that hides or alters what D returned or how the prompt ended."""

    INCLUDE_REASONING_FALSE = "include_reasoning_false"
    N = "n"
    BEAM_SEARCH = "use_beam_search"
    STOP = "stop"
    ECHO = "echo"
    CHAT_TEMPLATE = "chat_template"
    CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
    REASONING_EFFORT = "reasoning_effort"
    NO_GENERATION_PROMPT = "add_generation_prompt_false"
    CONTINUE_FINAL_MESSAGE = "continue_final_message"


_REASONING_PARTS: Final = frozenset({Part.REASONING, Part.REASONING_CONTENT, Part.THINK_TAG})
_TOOL_PARTS: Final = frozenset({Part.TOOL_CALLS, Part.FUNCTION_CALL})
_UNVERIFIABLE_PARTS: Final = frozenset({Part.REFUSAL, Part.OTHER})
_UNVERIFIABLE_OPTIONS: Final = frozenset(Option) - {Option.INCLUDE_REASONING_FALSE, Option.STOP}
# Priority when several reasons apply: the one an operator can act on first.
_PRIORITY: Final = (TrimReason.REASONING_HIDDEN, TrimReason.REASONING_STRIPPED, TrimReason.TOOL_CALL_RERENDERED,
                    TrimReason.UNVERIFIABLE, TrimReason.REPLY_EDITED, TrimReason.REPLY_ABSENT)


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, slots=True)
class ReplyRecord:
    """What D returned for one turn, as far as the next prompt can be checked against it."""

    content_sha256: str | None       # sha256 hex of the content text (UTF-8); None when it could not be read
    content_bytes: int = 0
    parts: frozenset[str] = frozenset()    # Part values seen
    options: frozenset[str] = frozenset()  # Option values the request carried
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_reason_seen: bool = False   # the server reported stop_reason (vLLM always does)
    completion_tokens: int | None = None
    choices: int = 1                 # distinct choice indexes seen

    def blockers(self) -> list[TrimReason]:
        """Why the reply cannot be reused in full whatever the next prompt holds, by priority."""
        reasons: set[TrimReason] = set()
        if Option.INCLUDE_REASONING_FALSE in self.options:
            reasons.add(TrimReason.REASONING_HIDDEN)
        if self.parts & _REASONING_PARTS:
            reasons.add(TrimReason.REASONING_STRIPPED)
        if self.parts & _TOOL_PARTS:
            reasons.add(TrimReason.TOOL_CALL_RERENDERED)
        if (self.content_sha256 is None or self.parts & _UNVERIFIABLE_PARTS or self.options & _UNVERIFIABLE_OPTIONS
                or self.choices != 1 or self._stopped_by_string()):
            reasons.add(TrimReason.UNVERIFIABLE)
        return [r for r in _PRIORITY if r in reasons]

    def _stopped_by_string(self) -> bool:
        # A stop string's tokens were generated (D holds KV for them) but are cut from the text.
        # A stop token id is the last token, which D holds no KV for, so it does not matter.
        if isinstance(self.stop_reason, str):
            return True
        return Option.STOP in self.options and not self.stop_reason_seen and self.finish_reason == "stop"


@dataclass(frozen=True, slots=True)
class Rung:
    """A past turn boundary: the prompt's first ``length`` messages (chat) or bytes (completions)."""

    length: int
    digest: str            # truncated sha256 over the render context and that prefix
    tokens: int | None     # P's usage.prompt_tokens for that turn's prompt (None: not reported)
    # ``tokens`` is D's whole sequence of that turn, proven when the next turn sent the reply back
    # verbatim (no generation prompt at its end, so no margin applies)
    exact: bool = False
    query: bool = False    # the prefix ends with a user query (kept longest: fallback after a query moves)


@dataclass(frozen=True, slots=True)
class TokenTrace:
    """Token-exact form of D's sequence: prefix hashes every ``step`` of its first ``count`` tokens, and at the end."""

    step: int
    count: int
    checkpoints: bytes     # 8 bytes per checkpoint, at step, 2*step, ... <= count, then at count itself

    def positions(self) -> list[int]:
        """The token positions the checkpoints stand for."""
        return _positions(self.step, self.count)[:len(self.checkpoints) // 8]

    def matched(self, ids: Sequence[int]) -> int:
        """Leading tokens of ``ids`` proven equal to D's sequence (a checkpoint position, or 0)."""
        data = _id_bytes(ids)
        h = hashlib.sha256()
        done = matched = 0
        for k, end in enumerate(self.positions()):
            if end > len(ids):
                break
            h.update(data[done * 4:end * 4])
            done = end
            if h.digest()[:8] != self.checkpoints[k * 8:(k + 1) * 8]:
                break
            matched = end
        return matched


def token_trace(ids: Sequence[int], count: int, step: int, max_checkpoints: int = MAX_CHECKPOINTS) -> TokenTrace:
    """The trace of the first ``count`` ids; ``step`` grows (by multiples) to keep the size bounded."""
    count = max(0, min(count, len(ids)))
    step = max(1, step)
    if count // step > max_checkpoints - 1:
        step *= math.ceil(count / step / (max_checkpoints - 1))
    data = _id_bytes(ids[:count])
    h = hashlib.sha256()
    out = bytearray()
    done = 0
    for end in _positions(step, count):
        h.update(data[done * 4:end * 4])
        done = end
        out += h.digest()[:8]
    return TokenTrace(step, count, bytes(out))


def _positions(step: int, count: int) -> list[int]:
    if step < 1 or count < 1:
        return []
    out = list(range(step, count + 1, step))
    if count % step:
        out.append(count)
    return out


def _id_bytes(ids: Sequence[int]) -> bytes:
    # 4 bytes per id (machine order, the same on both sides of a comparison): vocabularies are far below 2**32.
    return array.array("I", ids).tobytes()


@dataclass(frozen=True, slots=True)
class Coverage:
    """What a stored handle is known to cover, kept with it for the next turn."""

    kind: str                              # CHAT or COMPLETION
    rungs: tuple[Rung, ...]                # oldest first; the last one is the handle's own prompt
    reply: ReplyRecord | None
    continuation: tuple[int, str] | None = None  # completions: (bytes, sha256) of prompt + generated text
    block_size: int | None = None          # D's block size when known at store time
    tokens: TokenTrace | None = None       # --verify-tokens: D's sequence
    last_query: int | None = None          # chat: index of the last user query in the handle's own prompt

    def lengths(self) -> list[int]:
        """The prefix lengths a new prompt must be digested at to match the rungs."""
        out = [r.length for r in self.rungs]
        if self.kind == CHAT and self.rungs:
            out.append(self.rungs[-1].length + 1)  # the reply's message: a verbatim reply becomes a rung
        if self.continuation is not None:
            out.append(self.continuation[0])
        return out


# ---------------------------------------------------------------------------------------------- the prompt
@dataclass(frozen=True, slots=True)
class PromptView:
    """The new request as the rule sees it: digests of its prefixes and what the reply check needs."""

    kind: str
    length: int                      # messages or prompt bytes
    digest: str                      # of the whole prompt
    digests: Mapping[int, str]       # of the prefixes of the asked lengths (that exist)
    messages: Sequence[Any] = ()     # chat: the request's messages (not copied)
    first_reasoning: int | None = None  # chat: index of the first assistant message carrying reasoning
    reasoning_at: tuple[int, ...] = ()  # chat: indexes of every assistant message carrying reasoning
    last_query: int = -1                # chat: index of the last user query (-1: none)
    # chat: prefix lengths (below the whole prompt) that end with the leading system messages or with a
    # user query: where a rendering of the prefix alone ends as it does inside any longer prompt
    clean: tuple[int, ...] = ()
    head: int = 0                       # chat: how many leading system messages (0: none)

    def matches(self, rung: Rung) -> bool:
        """True when the prompt starts with the prefix ``rung`` was made for."""
        return self.digests.get(rung.length) == rung.digest


def render_context(body: Mapping[str, Any], kind: str) -> bytes:
    """The request fields that shape the whole rendering, canonically encoded."""
    names = RENDER_FIELDS if kind == CHAT else COMPLETION_RENDER_FIELDS
    ctx = {name: body[name] for name in names if body.get(name) is not None}
    if not ctx:
        return kind.encode()
    return kind.encode() + b"\x00" + json.dumps(ctx, sort_keys=True, separators=(",", ":"),
                                                ensure_ascii=False).encode("utf-8", "surrogatepass")


def unsupported_shape(body: Mapping[str, Any]) -> str | None:
    """Why the rule cannot check this request against a later one (None: it can)."""
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and truncate is not False:
        return "truncate_prompt_tokens shifts the prompt's start"
    messages = body.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return "messages is not a list of objects"
        return None
    if not isinstance(body.get("prompt"), str):
        return "prompt is not a single string"
    return None


def prompt_view(body: Mapping[str, Any], lengths: Iterable[int] = ()) -> PromptView | None:
    """Digest the request's prompt at each of ``lengths`` in one pass; None for an unsupported shape."""
    if unsupported_shape(body) is not None:
        return None
    wanted = set(lengths)
    messages = body.get("messages")
    if isinstance(messages, list):
        h = hashlib.sha256(render_context(body, CHAT))
        digests: dict[int, str] = {}
        if 0 in wanted:
            digests[0] = h.hexdigest()[:DIGEST_HEX]
        reasoning_at: list[int] = []
        last_query = -1
        clean: list[int] = []
        head = 0
        for i, message in enumerate(messages, start=1):
            _feed_message(h, message)
            boundary = False
            if _carries_reasoning(message):
                reasoning_at.append(i - 1)
            elif is_user_query(message):
                last_query = i - 1
                boundary = isinstance(message.get("content"), str | list)  # the template's query test agrees
            elif head == i - 1 and isinstance(message, dict) and message.get("role") == "system":
                head = i
                boundary = True
            if boundary and i < len(messages):
                clean.append(i)
            if i in wanted or (boundary and i < len(messages)):
                digests[i] = h.hexdigest()[:DIGEST_HEX]
        return PromptView(CHAT, len(messages), h.hexdigest()[:DIGEST_HEX], digests, messages,
                          reasoning_at[0] if reasoning_at else None, tuple(reasoning_at), last_query,
                          tuple(clean), head)
    data = str(body["prompt"]).encode("utf-8", "surrogatepass")
    h = hashlib.sha256(render_context(body, COMPLETION))
    digests = {}
    done = 0
    for length in sorted(n for n in wanted if 0 <= n <= len(data)):
        h.update(data[done:length])
        done = length
        digests[length] = h.hexdigest()[:DIGEST_HEX]
    h.update(data[done:])
    return PromptView(COMPLETION, len(data), h.hexdigest()[:DIGEST_HEX], digests)


def continuation_digest(body: Mapping[str, Any], text: str) -> tuple[int, str]:
    """Completions: (bytes, digest) of the prompt followed by the generated text, as a later prompt holds it."""
    data = (str(body.get("prompt", "")) + text).encode("utf-8", "surrogatepass")
    h = hashlib.sha256(render_context(body, COMPLETION))
    h.update(data)
    return len(data), h.hexdigest()[:DIGEST_HEX]


_CANONICAL: Final = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _feed_message(h: Any, message: Any) -> None:
    # Messages whose fields are all strings (user, system, tool results, plain replies) are fed as
    # length-prefixed fields: no JSON escaping of long tool outputs, and the encoding stays injective.
    # Anything else (tool calls, content parts) is canonical JSON.
    if isinstance(message, dict) and len(message) == 2:
        role, content = message.get("role"), message.get("content")
        if isinstance(role, str) and isinstance(content, str):  # the common {"role", "content"} message
            r = role.encode("utf-8", "surrogatepass")
            c = content.encode("utf-8", "surrogatepass")
            h.update(b"\x1b" + len(r).to_bytes(4, "little") + r + len(c).to_bytes(8, "little"))
            h.update(c)
            h.update(b"\x1e")
            return
    if isinstance(message, dict) and all(isinstance(v, str) for v in message.values()):
        h.update(b"\x1c")
        for key in sorted(message):
            k = key.encode("utf-8", "surrogatepass")
            v = message[key].encode("utf-8", "surrogatepass")
            h.update(len(k).to_bytes(4, "little") + k + len(v).to_bytes(8, "little"))
            h.update(v)
    else:
        h.update(b"\x1d")
        h.update(_CANONICAL.encode(message).encode("utf-8", "surrogatepass"))
    h.update(b"\x1e")


def _carries_reasoning(message: Any) -> bool:
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return False
    if any(message.get(key) for key in REASONING_KEYS):
        return True
    return has_think_tag(message.get("content"))


def is_user_query(message: Any) -> bool:
    """True for a user message that templates count as the query (not a tool result wrapped as user)."""
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        return True
    return not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))


def trusted_length(coverage: Coverage, view: PromptView) -> int:
    """How many leading messages of the prompt render as they did in the handle's own prompt.

    Reasoning-model templates (Qwen3, GLM, gpt-oss) keep an assistant message's reasoning only when
    it comes after the last user query. An assistant message carrying reasoning therefore renders
    differently once the last query moves past it (or back before it); messages without reasoning
    render alike on both sides. Without the handle's last query (an older handle), every message
    carrying reasoning is distrusted.
    """
    if coverage.last_query is None:
        return view.first_reasoning if view.first_reasoning is not None else view.length
    lo, hi = sorted((coverage.last_query, view.last_query))
    for m in view.reasoning_at:
        if lo < m < hi:
            return m
    return view.length


def has_think_tag(content: Any) -> bool:
    """True when ``content`` (a string or a list of text parts) contains a reasoning tag."""
    if isinstance(content, str):
        return any(tag in content for tag in THINK_TAGS)
    if isinstance(content, list):
        return any(isinstance(p, dict) and has_think_tag(p.get("text")) for p in content)
    return False


def request_options(body: Mapping[str, Any]) -> frozenset[str]:
    """The :class:`Option` values a request carries."""
    out: set[str] = set()
    if body.get("include_reasoning") is False:
        out.add(Option.INCLUDE_REASONING_FALSE)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        out.add(Option.N)
    if body.get("use_beam_search"):
        out.add(Option.BEAM_SEARCH)
    if body.get("stop"):
        out.add(Option.STOP)
    if body.get("echo"):
        out.add(Option.ECHO)
    if body.get("chat_template") is not None:
        out.add(Option.CHAT_TEMPLATE)
    if body.get("chat_template_kwargs"):
        out.add(Option.CHAT_TEMPLATE_KWARGS)
    if body.get("reasoning_effort") is not None:
        out.add(Option.REASONING_EFFORT)
    if body.get("add_generation_prompt") is False:
        out.add(Option.NO_GENERATION_PROMPT)
    if body.get("continue_final_message"):
        out.add(Option.CONTINUE_FINAL_MESSAGE)
    return frozenset(out)


def message_parts(message: Mapping[str, Any]) -> set[str]:
    """The :class:`Part` values a reply message or delta carries (beyond role and content)."""
    out: set[str] = set()
    for key, value in message.items():
        if key in ("role", "content") or value is None or value == "" or value == [] or value == {}:
            continue
        try:
            out.add(Part(key))
        except ValueError:
            out.add(Part.OTHER)
    return out


# ---------------------------------------------------------------------------------------------- the decision
@dataclass(frozen=True, slots=True)
class Decision:
    """How much of the handle to inject, and why not more."""

    reuse: Reuse
    limit_tokens: int                 # remote_num_tokens to inject (0 for NONE)
    reason: TrimReason | None = None  # why the handle was cut (None for FULL)
    detail: str = ""
    rung: int | None = None           # index of the rung the limit comes from
    matched: int = -1                 # index of the highest rung the prompt reproduces (-1: none)


def decide(coverage: Coverage | None, view: PromptView | None, *, handle_tokens: int, block_size: int | None,
           margin: int = DEFAULT_MARGIN) -> Decision:
    """The most of D's handle the new prompt is shown to reproduce.

    FULL: the previous prompt is reproduced and followed by D's reply verbatim (chat: an assistant
    message with exactly the recorded content and nothing else; completions: the generated text),
    and nothing in the reply or the request hides tokens. TRIMMED: the prompt reproduces a past turn
    boundary; the handle is cut to that turn's prompt tokens minus ``margin``, rounded down to
    whole blocks. NONE: nothing (or less than one block) is proven.
    """
    if coverage is None:
        return Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE, "the handle carries no record of what it covers")
    if view is None:
        return Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE, "the request's shape cannot be checked")
    if view.kind != coverage.kind or not coverage.rungs:
        return Decision(Reuse.NONE, 0, TrimReason.HISTORY_EDITED, "the prompt is of another kind")
    rungs = coverage.rungs
    matched = -1
    for i in range(len(rungs) - 1, -1, -1):
        if view.matches(rungs[i]):
            matched = i
            break
    if matched < 0:
        return Decision(Reuse.NONE, 0, TrimReason.HISTORY_EDITED,
                        "the prompt does not start with any earlier turn's prompt")
    newest = len(rungs) - 1
    trusted = trusted_length(coverage, view)
    if matched == newest:
        reasons = _reply_reasons(coverage, view)
        if not reasons and rungs[newest].length <= trusted and handle_tokens > 0:
            return Decision(Reuse.FULL, handle_tokens, rung=newest, matched=matched)
        reason = reasons[0] if reasons else TrimReason.HISTORY_REASONING
        detail = f"previous prompt reproduced; {reason.value}"
    else:
        reason = TrimReason.HISTORY_EDITED
        detail = f"the prompt reproduces turn boundary {matched + 1} of {len(rungs)}, not the previous prompt"
    index = matched
    while index >= 0 and (rungs[index].length > trusted or rungs[index].tokens is None):
        if rungs[index].length > trusted:
            reason = TrimReason.HISTORY_REASONING
            detail = f"history message {trusted} carries reasoning the template may re-render"
        index -= 1
    if index < 0:
        return Decision(Reuse.NONE, 0, reason, detail + "; no earlier boundary to fall back to", matched=matched)
    if block_size is None or block_size < 1:
        return Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE,
                        detail + "; D's block size is unknown, so the handle cannot be cut", index, matched)
    tokens = rungs[index].tokens
    assert tokens is not None
    if rungs[index].exact:
        margin = 0  # a verbatim reply's end: D's own sequence, no generation prompt after it
    limit = min(max(tokens - margin, 0), handle_tokens) // block_size * block_size
    if limit < block_size:
        return Decision(Reuse.NONE, 0, reason, detail + f"; fewer than one block ({block_size} tokens) proven",
                        index, matched)
    return Decision(Reuse.TRIMMED, limit, reason, detail, index, matched)


def _reply_reasons(coverage: Coverage, view: PromptView) -> list[TrimReason]:
    reply = coverage.reply
    reasons = reply.blockers() if reply is not None else [TrimReason.UNVERIFIABLE]
    newest = coverage.rungs[-1]
    if coverage.kind == COMPLETION:
        cont = coverage.continuation
        if cont is None or view.digests.get(cont[0]) != cont[1]:
            reasons.append(TrimReason.REPLY_ABSENT if view.length == newest.length else TrimReason.REPLY_EDITED)
    elif reply is not None:
        if view.length <= newest.length:
            reasons.append(TrimReason.REPLY_ABSENT)
        else:
            message = view.messages[newest.length]
            if not isinstance(message, dict) or message.get("role") != "assistant":
                reasons.append(TrimReason.REPLY_ABSENT)
            elif not _verbatim(message, reply):
                reasons.append(TrimReason.REPLY_EDITED)
    return [r for r in _PRIORITY if r in reasons]


def _verbatim(message: Mapping[str, Any], reply: ReplyRecord) -> bool:
    content = message.get("content")
    if not isinstance(content, str) or reply.content_sha256 is None:
        return False
    data = content.encode("utf-8", "surrogatepass")
    if len(data) != reply.content_bytes or hashlib.sha256(data).hexdigest() != reply.content_sha256:
        return False
    # Fields a client echoes back empty (the openai SDK's message object) render as nothing.
    return all(value is None or value == [] for key, value in message.items() if key not in ("role", "content"))


def next_rungs(coverage: Coverage | None, decision: Decision | None, view: PromptView,
               prompt_tokens: int | None, max_rungs: int = MAX_RUNGS, *, clean: bool = False) -> tuple[Rung, ...]:
    """The ladder stored with this turn's handle: the earlier boundaries this prompt reproduced, then its own.

    An earlier boundary is kept only where this prompt renders as the handle's prompt did (so it
    also holds for the sequence D computes now). A reply the client sent back verbatim becomes a
    boundary of its own, at the end of D's previous sequence. With ``clean``, the prompt's clean
    boundaries that no kept rung marks (the system prompt's end, user queries) are added without a
    token count, for a later turn that diverges there to learn it (P's /tokenize).
    """
    kept: list[Rung] = []
    if coverage is not None and decision is not None and decision.matched >= 0 and coverage.kind == view.kind:
        trusted = trusted_length(coverage, view) if view.kind == CHAT else view.length
        kept = [r for r in coverage.rungs[:decision.matched + 1] if r.length < view.length and r.length <= trusted]
        if decision.reuse is Reuse.FULL and decision.matched == len(coverage.rungs) - 1:
            reply = _reply_rung(coverage, view, decision.limit_tokens)
            if reply is not None and reply.length < view.length and reply.length <= trusted:
                kept.append(reply)
    if clean and view.clean:
        # Only past the kept boundaries (below them, an unmarked one was dropped for room before), and the
        # system prompt's end. Counted later from this prompt's own rendering, so the reasoning rule
        # applies then, not here.
        top = kept[-1].length if kept else 0
        added = [Rung(p, view.digests[p], None, query=p > view.head) for p in view.clean
                 if (p > top or (p == view.head and not any(r.length == p for r in kept))) and p in view.digests]
        if added:
            kept = sorted(kept + added, key=lambda r: r.length)
    tokens = prompt_tokens if isinstance(prompt_tokens, int) and prompt_tokens > 0 else None
    query = view.kind == CHAT and view.length > 0 and view.last_query == view.length - 1
    return (*_retain(kept, max_rungs - 1, view.head), Rung(view.length, view.digest, tokens, query=query))


def _reply_rung(coverage: Coverage, view: PromptView, handle_tokens: int) -> Rung | None:
    if handle_tokens <= 0:
        return None
    if coverage.kind == COMPLETION:
        if coverage.continuation is None:
            return None
        return Rung(coverage.continuation[0], coverage.continuation[1], handle_tokens, exact=True)
    length = coverage.rungs[-1].length + 1
    found = view.digests.get(length)
    return Rung(length, found, handle_tokens, exact=True) if found is not None else None


def _retain(rungs: list[Rung], slots: int, head: int = 0) -> list[Rung]:
    """At most ``slots`` rungs: the system prompt's end, the newest half, then the older ones ending at a
    user query, newest first.

    A query boundary is where reuse falls back when a later user query changes how reasoning in
    the history renders, so those outlive the rest; the system prompt's end is where a compaction
    or an edit of the first user message falls back.
    """
    if slots <= 0:
        return []
    if len(rungs) <= slots:
        return rungs
    pinned = [r for r in rungs[:1] if head and r.length == head and slots > 1]
    rest = rungs[len(pinned):]
    slots -= len(pinned)
    recent = max(slots // 2, 1)
    older, newest = rest[:-recent], rest[-recent:]
    ranked = [r for r in reversed(older) if r.query] + [r for r in reversed(older) if not r.query]
    return pinned + sorted(ranked[:slots - recent], key=lambda r: r.length) + newest


# ---------------------------------------------------------------------------------------------- the handle
def blocks_per_group(params: Mapping[str, Any]) -> list[int] | None:
    """Lengths of the handle's block-id groups; None when they are not lists of ints."""
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) for g in groups):
        return None
    return [len(g) for g in groups]


def trim_handle(params: Mapping[str, Any], limit_tokens: int, block_size: int) -> dict[str, Any] | None:
    """D's params cut to their first ``limit_tokens`` (a multiple of ``block_size``); None if not cuttable.

    vLLM's reader end-trims the remote block list to the blocks P allocated for the external
    tokens, so ``remote_num_tokens`` and every block group must be cut together. A group whose
    length is not ``ceil(remote_num_tokens / block_size)`` (a sliding-window or state group, or a
    block size that does not fit) cannot be cut by position; neither can a context-parallel handle.
    """
    num_tokens = params.get("remote_num_tokens")
    lengths = blocks_per_group(params)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or lengths is None or block_size < 1:
        return None
    if limit_tokens % block_size or not 0 < limit_tokens <= num_tokens:
        return None
    dcp = params.get("dcp_size")
    if dcp not in (None, 1):
        return None
    expected = math.ceil(num_tokens / block_size)
    if any(n != expected for n in lengths):
        return None
    keep = limit_tokens // block_size
    out = dict(params)
    out["remote_num_tokens"] = limit_tokens
    out["remote_block_ids"] = [list(g[:keep]) for g in params["remote_block_ids"]]
    digest = params.get("kvdiag_digest")
    if digest is not None:
        out["kvdiag_digest"] = trim_digest(digest, keep)
    return out


def trim_digest(digest: Any, blocks: int) -> Any:
    """The connector's block-hash digest cut to its first ``blocks`` blocks (a prefix checkpoint list).

    A digest this function cannot read is returned unchanged: P validates it and ignores a bad one.
    """
    if not isinstance(digest, dict):
        return digest
    stride, held, hashes = digest.get("stride"), digest.get("blocks"), digest.get("h")
    if not isinstance(stride, int) or stride < 1 or not isinstance(held, int) or not isinstance(hashes, list):
        return digest
    if blocks >= held:
        return digest
    out = {k: v for k, v in digest.items() if k != "tail"}
    out["blocks"] = blocks
    out["h"] = hashes[:blocks // stride]
    return out


def block_size_range(num_tokens: int, blocks: int) -> tuple[int, int] | None:
    """Block sizes ``bs`` with ``ceil(num_tokens / bs) == blocks`` as ``(lo, hi)``; None when there are none."""
    if num_tokens < 1 or blocks < 1 or blocks > num_tokens:
        return None
    lo = math.ceil(num_tokens / blocks)
    hi = (num_tokens - 1) // (blocks - 1) if blocks > 1 else 1 << 30
    return (lo, hi) if lo <= hi else None


@dataclass
class BlockSizeBook:
    """Block sizes inferred per engine id from the handles seen (bounded; oldest engines forgotten).

    Every handle narrows the engine's range of sizes consistent with it; the size is known once
    the range holds one value. A handle that fits no size marks the engine inconsistent for good.
    """

    capacity: int = 1024
    _ranges: OrderedDict[str, tuple[int, int] | None] = field(default_factory=OrderedDict)

    def observe(self, engine_id: Any, params: Mapping[str, Any]) -> None:
        """Narrow ``engine_id``'s range with one set of params (D's handle or P's)."""
        if not isinstance(engine_id, str):
            return
        digest = params.get("kvdiag_digest")
        exact = digest.get("block_size") if isinstance(digest, dict) else None
        num_tokens = params.get("remote_num_tokens")
        lengths = blocks_per_group(params)
        if isinstance(exact, int) and not isinstance(exact, bool) and exact > 0:
            new: tuple[int, int] | None = (exact, exact)
        elif isinstance(num_tokens, int) and not isinstance(num_tokens, bool) and num_tokens > 0 and lengths:
            new = block_size_range(num_tokens, max(lengths))
        else:
            return
        old = self._ranges.get(engine_id, (1, 1 << 30))
        if old is None or new is None:
            merged = None
        else:
            lo, hi = max(old[0], new[0]), min(old[1], new[1])
            merged = (lo, hi) if lo <= hi else None
        self._ranges[engine_id] = merged
        self._ranges.move_to_end(engine_id)
        while len(self._ranges) > self.capacity:
            self._ranges.popitem(last=False)

    def block_size(self, engine_id: Any) -> int | None:
        """The engine's block size when the handles seen leave exactly one."""
        found = self._ranges.get(engine_id) if isinstance(engine_id, str) else None
        return found[0] if found is not None and found[0] == found[1] else None
