"""The sim's chat template: Qwen3's, rendered in Python, after vLLM's own message preprocessing.

Qwen3's template (the one shipped with Qwen/Qwen3-32B) decides where a multi-turn prompt stops
reproducing what the model generated, so the sim follows its structure:

* ``tools`` go into the system turn (``# Tools`` ... ``<tools>`` one JSON object per line
  ``</tools>`` and the ``<tool_call>`` instruction), after the first system message's text;
* the *last query* is the last ``user`` message that is not a wrapped ``<tool_response>``;
* an assistant message's reasoning is its ``reasoning`` / ``reasoning_content`` field, else the
  part of its content before ``</think>`` (the content keeps only what follows). Only assistant
  messages after the last query keep it, rendered ``<think>\\n…\\n</think>\\n\\n`` (the final
  message always, earlier ones when they have reasoning); every earlier message loses it;
* tool calls are re-rendered from the structured message: ``<tool_call>\\n{"name": "…",
  "arguments": …}\\n</tool_call>``, a newline before each call but a first one without content;
* ``tool`` messages become a user turn of ``<tool_response>`` blocks (consecutive ones share it);
* the generation prompt is ``<|im_start|>assistant\\n``, plus ``<think>\\n\\n</think>\\n\\n`` when
  ``chat_template_kwargs.enable_thinking`` is false.

vLLM first turns every text content into a string (parts joined by newlines), renames a
message's deprecated ``reasoning_content`` to ``reasoning``, and parses each tool call's
``arguments`` string into an object (invalid JSON becomes ``{}``), so the template always
re-serializes arguments with ``json.dumps`` (``", "`` and ``": "`` separators): a call the model
wrote as compact JSON comes back different.

Usage::

    text = render_text(messages, tools=tools, chat_template_kwargs={"enable_thinking": False})
    ids = tokenize(text)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError
from kvdiag.sim.tokenizer import message_text

GENERATION_PROMPT: Final = "<|im_start|>assistant\n"
EMPTY_THINK: Final = "<think>\n\n</think>\n\n"
_TOOLS_HEADER: Final = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER: Final = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                        '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


class TemplateError(KVDiagError, ValueError):
    """Messages or options the chat template cannot render (vLLM answers HTTP 400)."""


def tojson(value: Any) -> str:
    """The template's ``tojson`` filter (Hugging Face: ``json.dumps`` with ``ensure_ascii=False``)."""
    return json.dumps(value, ensure_ascii=False)


def think_block(reasoning: str) -> str:
    """A reasoning trace as the template renders it (and as the model writes it)."""
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"


def tool_call_text(name: str, arguments: Any) -> str:
    """One tool call as the template renders it (``arguments`` verbatim when a string, else JSON)."""
    args = arguments if isinstance(arguments, str) else tojson(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _parse_arguments(raw: Any) -> Any:
    """vLLM's history preprocessing: a JSON string becomes an object; anything unusable becomes ``{}``."""
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    parsed: Any = None
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):  # (not JSON; an integer past 4300 digits; deep nesting)
            parsed = None
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(msg: Mapping[str, Any]) -> list[tuple[str, Any]]:
    raw = msg.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TemplateError("assistant 'tool_calls' must be a list")
    calls: list[tuple[str, Any]] = []
    for item in raw:
        if not isinstance(item, Mapping):
            raise TemplateError("assistant tool_calls entries must be objects.")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise TemplateError("chat completions only support assistant tool_calls of type 'function'.")
        calls.append((str(function.get("name", "")), _parse_arguments(function.get("arguments"))))
    return calls


def _reasoning_field(msg: Mapping[str, Any]) -> str | None:
    for key in ("reasoning", "reasoning_content"):
        value = msg.get(key)
        if value is not None:
            return value if isinstance(value, str) else None
    return None


def _is_query(msg: Mapping[str, Any]) -> bool:
    if msg.get("role") != "user":
        return False
    content = message_text(msg.get("content"))
    return not (content.startswith("<tool_response>") and content.endswith("</tool_response>"))


def _assistant(msg: Mapping[str, Any], keep_reasoning: bool, is_last: bool) -> str:
    content = message_text(msg.get("content"))
    reasoning = _reasoning_field(msg)
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    if keep_reasoning and (is_last or reasoning):
        out = GENERATION_PROMPT + think_block(reasoning) + content.lstrip("\n")
    else:
        out = GENERATION_PROMPT + content
    for j, (name, arguments) in enumerate(_tool_calls(msg)):
        if j > 0 or content:
            out += "\n"
        out += tool_call_text(name, arguments)
    return out + "<|im_end|>\n"


def render_text(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                tools: Sequence[Any] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
                continue_final_message: bool = False) -> str:
    """The prompt text of ``messages``; raise TemplateError on what vLLM would reject."""
    if continue_final_message and add_generation_prompt:
        raise TemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not all(isinstance(m, Mapping) for m in messages):
        raise TemplateError("'messages' must be a list of message objects")
    kwargs = chat_template_kwargs or {}
    out: list[str] = []
    first_system = bool(messages) and messages[0].get("role") == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if first_system:
            out.append(message_text(messages[0].get("content")) + "\n\n")
        out.append(_TOOLS_HEADER)
        out.extend("\n" + tojson(tool) for tool in tools)
        out.append(_TOOLS_FOOTER)
    elif first_system:
        out.append(f"<|im_start|>system\n{message_text(messages[0].get('content'))}<|im_end|>\n")
    last_query = next((i for i in range(len(messages) - 1, -1, -1) if _is_query(messages[i])), len(messages) - 1)
    for i, msg in enumerate(messages):
        role = msg.get("role")
        is_last = i == len(messages) - 1
        if role == "user" or (role == "system" and i > 0):
            out.append(f"<|im_start|>{role}\n{message_text(msg.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            out.append(_assistant(msg, i > last_query, is_last))
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{message_text(msg.get('content'))}\n</tool_response>")
            if is_last or messages[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
    text = "".join(out)
    if continue_final_message:
        return _cut_after_final(text, messages)
    if add_generation_prompt:
        text += GENERATION_PROMPT
        if kwargs.get("enable_thinking") is False:
            text += EMPTY_THINK
    return text


def _cut_after_final(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """Hugging Face's ``continue_final_message``: the prompt ends right after the final message's text."""
    final = message_text(messages[-1].get("content")).strip() if messages else ""
    if not final or final not in text:
        raise TemplateError("continue_final_message is set but the final message's content is not in the "
                            "rendered prompt")
    return text[:text.rindex(final) + len(final)]
