"""What D returned for one turn, read from its SSE bytes (once, at the end) or its JSON body.

The router needs, for the next turn's reuse rule, the reply's content text, which non-content
parts appeared (reasoning, tool calls, refusals, ...), the finish and stop reasons, and with
``--verify-tokens`` the token ids; plus, as before, D's ``kv_transfer_params``, usage and errors.

Streams are parsed in one pass over the recorded bytes. Token frames of the shape vLLM (and the
emulated engines) write, ``data: {"id":…,"choices":[{"index":0,"delta":{"content":"…"},…}]}``, are
matched by one compiled regular expression (C code, no per-frame Python); every other frame (the
role frame, the final frame with the params, usage, tool-call deltas, other servers' layouts) is
``json.loads``-ed on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.router.reuse_rule import Part, message_parts

PARAMS_KEY: Final = "kv_transfer_params"

_LIT: Final = rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # a JSON string (unrolled: fast in sre)
# Each token frame's output is one delta holding one text field (chat) or one text (completions).
# Both patterns start with a literal, so sre scans for it at C speed; a delta of another shape (a
# tool call, a refusal, several fields) leaves the content groups empty and sends the stream to the
# frame-by-frame parser.
_DELTA: Final = re.compile(rb'"delta": ?(?:\{(?:"role": ?"assistant", ?)?"(content|reasoning|reasoning_content)": ?('
                           + _LIT + rb')\}|\{(?:"content": ?null, ?)?"(tool_calls|function_call|refusal)": ?[\[\{"]'
                           rb'|(\{\})|)')
_TEXT: Final = re.compile(rb'"text": ?(' + _LIT + rb")")
_TOKEN_IDS: Final = re.compile(rb'"token_ids": ?(null|\[[\d, ]*\])')
_PARAMS_MARKERS: Final = (b'"kv_transfer_params"', b'"finish_reason":"', b'"finish_reason": "', b'"error"')
# What makes a frame more than output; such frames open (prompt ids) and close (finish, params,
# usage, errors) a stream.
_EDGE: Final = re.compile(rb'"(?:finish_reason": ?"|kv_transfer_params": ?\{|usage": ?\{|error"|prompt_token_ids": ?\['
                          rb'|stop_reason":)')
_EDGE_FRAMES: Final = 4  # frames at the end of a stream that may carry them


@dataclass(slots=True)
class Observed:
    """Everything read from D's answer; filled by :func:`parse_stream` or :func:`observe_body`."""

    pieces: list[str] = field(default_factory=list)   # choice 0's content (chat) or text (completions)
    parts: set[str] = field(default_factory=set)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stop_reason_seen: bool = False
    indexes: set[int] = field(default_factory=set)
    params: dict[str, Any] | None = None
    params_present: bool = False
    usage: dict[str, Any] | None = None
    error: Any = None
    malformed: str | None = None      # a frame that should carry params/finish/error is not JSON
    unreadable: bool = False          # some of the reply could not be read (overflow, a bad token frame)
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    ids_complete: bool = True         # every piece of output came with its token ids
    done: bool = False
    frames_parsed: int = 0

    @property
    def content(self) -> str:
        """Choice 0's text."""
        return "".join(self.pieces)

    @property
    def completion_tokens(self) -> int | None:
        """usage.completion_tokens when D reported it."""
        value = (self.usage or {}).get("completion_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def take_choice(self, choice: Mapping[str, Any], *, stream: bool, content: bool = True) -> None:
        """Record one choice object (a stream delta's or a response's); ``content``: its output too."""
        index = choice.get("index", 0)
        index = index if isinstance(index, int) else -1
        self.indexes.add(index)
        if "stop_reason" in choice:
            self.stop_reason_seen = True
            if choice["stop_reason"] is not None:
                self.stop_reason = choice["stop_reason"]
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        message = choice.get("delta") if stream else choice.get("message")
        text: Any = None
        if isinstance(message, dict):
            text = message.get("content")
            if content:
                self.parts |= message_parts(message)
        elif isinstance(choice.get("text"), str):
            text = choice["text"]
        if index != 0 or not content:
            return
        if isinstance(text, str):
            self.pieces.append(text)
        elif text is not None:
            self.parts.add(Part.OTHER)  # content parts, audio, ...: not plain text
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self._add_ids(ids)
        elif text or (stream and isinstance(message, dict) and message_parts(message)):
            self.ids_complete = False
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_ids is None:
            self.prompt_ids = prompt_ids

    def _add_ids(self, ids: list[Any]) -> None:
        if self.output_ids is None:
            self.output_ids = []
        self.output_ids.extend(ids)

    def take_top(self, obj: Mapping[str, Any]) -> None:
        """Record a frame's or body's top-level fields (params, usage, errors, prompt ids)."""
        if "error" in obj or obj.get("object") == "error":
            self.error = obj.get("error", obj)
        if PARAMS_KEY in obj:
            value = obj[PARAMS_KEY]
            self.params_present = True
            if isinstance(value, dict):
                self.params = value
            elif value is not None:
                self.malformed = f"{PARAMS_KEY} in the decode stream is not an object"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        prompt_ids = obj.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.prompt_ids is None:
            self.prompt_ids = prompt_ids


def drop_token_ids(obj: dict[str, Any]) -> None:
    """Token ids the router asked D for, removed from a body whose client did not ask for them."""
    if obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            for key in ("token_ids", "prompt_token_ids"):
                if choice.get(key) is not None:
                    choice[key] = None


def observe_body(obj: Mapping[str, Any]) -> Observed:
    """What a non-streaming response carries (chat ``message`` or completions ``text``)."""
    out = Observed(done=True)
    out.take_top(obj)
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                out.take_choice(choice, stream=False)
    return out


def has_done(data: bytes | bytearray, start: int = 0) -> bool:
    """True when ``data`` holds a ``data: [DONE]`` line at or after ``start`` (never inside a JSON string)."""
    pos = data.find(b"[DONE]", start)
    while pos >= 0:
        line = data.rfind(b"\n", 0, pos) + 1
        after = pos + 6
        if data[line:pos].strip() == b"data:" and (after == len(data) or data[after] in b"\r\n"):
            return True
        pos = data.find(b"[DONE]", after)
    return False


def parse_stream(data: bytes, *, chat: bool = True, single_choice: bool = True, token_ids: bool = False,
                 truncated: bool = False) -> Observed:
    """Read recorded SSE bytes (whole frames).

    ``chat``: chat deltas (else completion texts); ``single_choice``: the request asked for one
    choice (else every frame is parsed); ``token_ids``: collect output token ids; ``truncated``:
    the start of the stream was dropped (the record is then unreadable).
    """
    out = Observed(unreadable=truncated, done=has_done(data))
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    if truncated:
        cut = data.find(b"\n\n")
        data = data[cut + 2:] if cut >= 0 else b""
    if chat:
        # (key, literal, part, empty): a one-field text delta; a delta that opens with a tool call,
        # function call or refusal (recorded as that part; its text is never needed); an empty one.
        found = _DELTA.findall(data)
        simple = all(key or part or empty for key, _, part, empty in found)
        deltas = [(key or part, lit) for key, lit, part, empty in found if not empty]
        literals = [lit for key, lit in deltas if key == b"content"]
        count = len(deltas)
    else:
        literals = _TEXT.findall(data)
        simple, count = True, len(literals)
        deltas = []
    if not simple or not single_choice:
        # Tool-call deltas, several choices: every frame as JSON.
        _parse_frames(out, data.split(b"\n\n"), content=True)
        return out
    if count:
        out.indexes.add(0)
    if literals:
        try:
            out.pieces.extend(json.loads(b"[" + b",".join(literals) + b"]"))
        except ValueError:
            out.unreadable = True
    for key in {key for key, lit in deltas if key != b"content" and lit != b'""'}:
        out.parts.add(Part(key.decode()))
    if token_ids:
        ids = _TOKEN_IDS.findall(data)
        out.ids_complete = bool(ids) and b"null" not in ids and len(ids) >= count - 1
        inner = b",".join(i[1:-1] for i in ids if len(i) > 2)
        try:
            out.output_ids = json.loads(b"[" + inner + b"]")
        except ValueError:
            out.ids_complete = False
    # The frames that carry more than output open (prompt ids) and close (finish, params, usage,
    # errors) the stream: read those as JSON, without taking their output twice.
    first = data.find(b"\n\n")
    if first < 0:
        _parse_frames(out, [data], content=False)
        return out
    head = data[:first]
    if token_ids:
        head = _take_prompt_ids(out, head)
    tail = data[first + 2:].rsplit(b"\n\n", _EDGE_FRAMES + 1)[-_EDGE_FRAMES - 1:]
    edges = [f for f in (head, *tail) if _EDGE.search(f)]
    _parse_frames(out, edges, content=False)
    return out


def _take_prompt_ids(out: Observed, frame: bytes) -> bytes:
    """Read the first frame's prompt id list on its own (it can be hundreds of KiB); the frame without it."""
    key = frame.find(b'"prompt_token_ids":[')
    if key < 0:
        return frame
    start = key + len(b'"prompt_token_ids":')
    end = frame.find(b"]", start)
    if end < 0:
        return frame
    try:
        ids = json.loads(frame[start:end + 1])
    except ValueError:
        return frame
    out.prompt_ids = ids
    return frame[:start] + b"null" + frame[end + 1:]


def _parse_frames(out: Observed, frames: list[bytes], *, content: bool) -> None:
    for frame in frames:
        if not frame:
            continue
        payload = b"\n".join(line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:"))
        if not payload or payload.strip() == b"[DONE]":
            continue  # comments, event:/id: lines, the end marker
        out.frames_parsed += 1
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            if any(marker in frame for marker in _PARAMS_MARKERS):
                out.malformed = f"decode stream frame is not JSON ({exc})"
            else:
                out.unreadable = True
            continue
        if not isinstance(obj, dict):
            out.malformed = "decode stream frame is not a JSON object"
            continue
        out.take_top(obj)
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    out.take_choice(choice, stream=True, content=content)
