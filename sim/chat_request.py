"""One OpenAI request body, validated as vLLM 0.33 does, into what the emulated engine needs.

The prompt (chat template or completion prompt), ``max_tokens``, ``kv_transfer_params``, the
streaming options, ``return_token_ids``, the tool fields (``tools``, ``tool_choice``,
``parallel_tool_calls``), ``include_reasoning``, ``chat_template_kwargs``,
``add_generation_prompt`` / ``continue_final_message``, and the sim's ``kvdiag_sim`` hint become
a :class:`ParsedRequest`: the prompt ids, the :class:`~kvdiag.sim.model_output.OutputPlan` of what
the model writes and the :class:`~kvdiag.sim.output_parser.ParserSetup` of what the client sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.sim.chat_template import TemplateError, render_text
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.model_output import HINT_KEY, HintError, OutputPlan, SimHint, ToolRequest, make_plan
from kvdiag.sim.openai_api import BadRequest, bool_field
from kvdiag.sim.output_parser import ParserSetup
from kvdiag.sim.tokenizer import tokenize

MAX_PROMPT_TOKENS: Final = 1_000_000


@dataclass
class ParsedRequest:
    """What the engine and the response writer need from one request."""

    kind: str  # "chat" or "completion"
    prompt: list[int]
    max_tokens: int
    params: dict[str, Any] | None
    stream: bool = False
    include_usage: bool = False
    seed: int = 0
    return_token_ids: bool = False
    plan: OutputPlan = field(default_factory=OutputPlan)
    setup: ParserSetup = field(default_factory=ParserSetup)
    forced_tools: bool = False  # tool_choice required or a named function
    named_tool: bool = False




def parse_tools(body: Mapping[str, Any]) -> ToolRequest:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` with vLLM's defaults and errors."""
    tools = body.get("tools")
    if tools == []:
        raise BadRequest("`tools` must not be an empty array. Either provide at least one tool or omit the "
                         "field entirely.")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise BadRequest("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects")
    choice = body.get("tool_choice", "auto" if tools else "none")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false")
    if choice is None or choice == "none":
        return ToolRequest(tuple(tools or ()), "none", None, parallel)
    if not tools:
        raise BadRequest("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise BadRequest(f"Invalid value for `tool_choice`: {choice!r}! Correct usage: "
                             '`{"type": "function", "function": {"name": "my_function"}}`')
        return ToolRequest(tuple(tools), "named", name, parallel)
    if choice not in ("auto", "required"):
        raise BadRequest(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                         '"required" are supported.')
    return ToolRequest(tuple(tools), str(choice), None, parallel)


def _check_tool_parser(config: EngineConfig, tools: ToolRequest) -> bool:
    """Raise vLLM's error when the choice needs a parser the server lacks; True if tool calls are kept."""
    if tools.choice == "none":
        return False
    if config.tool_call_parser is None:
        if tools.choice == "auto" and not config.enable_auto_tool_choice:
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        desc = f'function "{tools.named}"' if tools.choice == "named" else f'"{tools.choice}"'
        raise BadRequest(f"tool_choice={desc} requires --tool-call-parser to be set")
    return tools.choice in ("required", "named") or config.enable_auto_tool_choice


def _chat_prompt(body: Mapping[str, Any], tools: ToolRequest) -> tuple[list[int], dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a list of message objects")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    try:
        text = render_text(messages, add_generation_prompt=bool_field(body, "add_generation_prompt", True),
                           tools=list(tools.tools) or None, chat_template_kwargs=kwargs,
                           continue_final_message=bool_field(body, "continue_final_message", False))
    except TemplateError as exc:
        raise BadRequest(str(exc)) from None
    return tokenize(text), kwargs or {}


def _completion_prompt(body: Mapping[str, Any]) -> list[int]:
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, str):
        return tokenize(raw)
    if isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return list(raw)
    raise BadRequest("'prompt' must be a string or a list of token ids")


def parse_request(config: EngineConfig, body: Any, kind: str) -> ParsedRequest:
    """Validate ``body`` for ``/v1/chat/completions`` (kind chat) or ``/v1/completions``; raise BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        hint = SimHint.parse(body.get(HINT_KEY))
    except HintError as exc:
        raise BadRequest(str(exc)) from None
    tools = ToolRequest()
    keep_tools = False
    kwargs: dict[str, Any] = {}
    if kind == "chat":
        tools = parse_tools(body)
        keep_tools = _check_tool_parser(config, tools)
        prompt, kwargs = _chat_prompt(body, tools)
    else:
        prompt = _completion_prompt(body)
    if not prompt or len(prompt) > MAX_PROMPT_TOKENS:
        raise BadRequest(f"the prompt must have 1..{MAX_PROMPT_TOKENS} tokens")
    if len(prompt) > config.max_model_len:
        raise BadRequest(f"This model's maximum context length is {config.max_model_len} tokens. However, your "
                         f"request has {len(prompt)} input tokens. Please reduce the length of the input messages.")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or config.default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 100_000:
        raise BadRequest("max_tokens must be an integer between 1 and 100000")
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("kv_transfer_params must be an object or null")
    opts = body.get("stream_options")
    seed = body.get("seed")
    thinking = kwargs.get("enable_thinking") is not False
    # A server with a reasoning parser serves a reasoning model: it always thinks (Qwen3 writes an
    # empty trace when it has nothing to think about), so the parser never mistakes content for a trace.
    reasoning = config.reasoning_tokens
    if reasoning is None and config.reasoning_parser is not None and kind == "chat":
        reasoning = 0
    plan = make_plan(hint, tools, thinking_enabled=thinking, default_reasoning=reasoning,
                     default_style=config.tool_call_style)
    setup = ParserSetup(reasoning=kind == "chat" and config.reasoning_parser is not None, thinking=thinking,
                        tools=keep_tools, include_reasoning=bool_field(body, "include_reasoning", True),
                        parallel=tools.parallel, reasoning_field=config.reasoning_field,
                        configured=kind == "chat" and (config.reasoning_parser is not None
                                                       or config.tool_call_parser is not None))
    return ParsedRequest(kind, prompt, max_tokens, params, stream=bool(body.get("stream", False)),
                         include_usage=isinstance(opts, dict) and bool(opts.get("include_usage")),
                         seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else 0,
                         return_token_ids=bool_field(body, "return_token_ids", False), plan=plan, setup=setup,
                         forced_tools=tools.choice in ("required", "named"), named_tool=tools.choice == "named")
