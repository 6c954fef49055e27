"""vLLM's ``/tokenize`` and ``/detokenize`` for the emulated engine (request and response shapes of vLLM 0.33).

``POST /tokenize`` takes either a chat (``messages``, ``add_generation_prompt`` (default true),
``continue_final_message``, ``chat_template_kwargs``, ``tools``, ``add_special_tokens``) or a
completion prompt (``prompt``, ``add_special_tokens`` default true), plus ``return_token_strs``,
and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` with exactly the ids the
chat or completions endpoint would prefill (the sim's tokenizer adds no BOS token, like Qwen3's).
``POST /detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``.
"""

from __future__ import annotations

from typing import Any

from kvdiag.sim.chat_request import parse_tools
from kvdiag.sim.chat_template import TemplateError, render_text
from kvdiag.sim.config import EngineConfig
from kvdiag.sim.openai_api import BadRequest, bool_field
from kvdiag.sim.tokenizer import TokenizerError, detokenize, token_text, tokenize


def tokenize_response(config: EngineConfig, body: Any) -> dict[str, Any]:
    """The ``/tokenize`` answer for ``body``; raise BadRequest as vLLM answers 400."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be a list of message objects")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object")
        tools = body.get("tools")
        tool_list = list(parse_tools({"tools": tools}).tools) if tools else None  # [] is accepted here
        bool_field(body, "add_special_tokens", False)
        try:
            text = render_text(messages, add_generation_prompt=bool_field(body, "add_generation_prompt", True),
                               tools=tool_list, chat_template_kwargs=kwargs,
                               continue_final_message=bool_field(body, "continue_final_message", False))
        except TemplateError as exc:
            raise BadRequest(str(exc)) from None
    elif isinstance(body.get("prompt"), str):
        bool_field(body, "add_special_tokens", True)
        text = body["prompt"]
    else:
        raise BadRequest("give 'messages' (a chat) or 'prompt' (a string)")
    tokens = tokenize(text)
    strs = [token_text(t) for t in tokens] if bool_field(body, "return_token_strs", False) else None
    return {"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize_response(body: Any) -> dict[str, Any]:
    """The ``/detokenize`` answer for ``{"tokens": [...]}``."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise BadRequest("'tokens' must be a list of non-negative integers")
    try:
        return {"prompt": detokenize(tokens)}
    except TokenizerError as exc:
        raise BadRequest(str(exc)) from None
