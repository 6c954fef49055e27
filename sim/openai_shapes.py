"""vLLM 0.33's response bodies and stream chunks, field for field, as its pydantic models serialize them.

Full responses are ``model_dump()`` (every field, nulls included; ``tool_calls`` dropped from a
message when empty). Chat stream chunks are ``model_dump_json(exclude_unset=True)``: a field the
server set explicitly appears even when null, so every token chunk carries ``"token_ids": null``
and ``"kv_transfer_params": null`` (the final chunk carries the params), and the first chunk
``"prompt_token_ids"`` and ``"prompt_text"``. The usage chunk (empty ``choices``) drops nulls.
With ``return_token_ids`` the prompt ids come at the top of the chat body (in the choice for
completions), the output ids in the choice; streamed, the prompt ids ride on the first chunk and
each chunk carries its own output ids. ``include_reasoning: false`` on a server with a parser
(reasoning or tool) also hides the output ids.
"""

from __future__ import annotations

import time
from typing import Any

from kvdiag.sim.output_parser import ParsedMessage

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION = "text_completion"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None,
          full: bool) -> dict[str, Any]:
    """``usage``; ``full`` keeps the nulls of a full response (a usage chunk drops them)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if full:
        details.update(created_cache_tokens=None, multimodal_tokens=None)
    out["prompt_tokens_details"] = details
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    elif full:
        out["completion_tokens_details"] = None
    return out


def chat_message(parsed: ParsedMessage, reasoning_field: str) -> dict[str, Any]:
    """The assistant ``message`` of a full chat response."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None, "annotations": None,
                           "audio": None, "function_call": None}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    msg[reasoning_field] = parsed.reasoning
    return msg


def chat_body(*, request_id: str, model: str, message: dict[str, Any], finish_reason: str | None,
              token_ids: list[int] | None, prompt_token_ids: list[int] | None, usage_obj: dict[str, Any],
              params: dict[str, Any] | None) -> dict[str, Any]:
    """A full ``chat.completion`` response."""
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "token_ids": token_ids, "routed_experts": None, "weight_versions": None}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage_obj,
            "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids, "prompt_text": None,
            "kv_transfer_params": params, "ec_transfer_params": None, "metrics": None}


def completion_body(*, request_id: str, model: str, text: str, finish_reason: str | None,
                    token_ids: list[int] | None, prompt_token_ids: list[int] | None, usage_obj: dict[str, Any],
                    params: dict[str, Any] | None) -> dict[str, Any]:
    """A full ``text_completion`` response."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "token_ids": token_ids, "prompt_logprobs": None, "prompt_token_ids": prompt_token_ids,
              "routed_experts": None, "weight_versions": None}
    return {"id": request_id, "object": COMPLETION, "created": int(time.time()), "model": model, "choices": [choice],
            "service_tier": None, "system_fingerprint": None, "usage": usage_obj, "kv_transfer_params": params,
            "ec_transfer_params": None, "metrics": None}


def chat_role_chunk(request_id: str, model: str, created: int, prompt_token_ids: list[int] | None) -> dict[str, Any]:
    """The first chat chunk: the role, and the prompt ids when asked."""
    return {"id": request_id, "object": CHAT_CHUNK, "created": created, "model": model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}],
            "prompt_token_ids": prompt_token_ids, "prompt_text": None}


def chat_chunk(request_id: str, model: str, created: int, delta: dict[str, Any], token_ids: list[int] | None,
               finish_reason: str | None, params: dict[str, Any] | None, with_params: bool) -> dict[str, Any]:
    """A chat token chunk; with ``finish_reason`` the final one (``stop_reason``, ``weight_versions``)."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    if finish_reason is not None:
        choice["weight_versions"] = None
    chunk: dict[str, Any] = {"id": request_id, "object": CHAT_CHUNK, "created": created, "model": model,
                             "choices": [choice]}
    if with_params:
        chunk["kv_transfer_params"] = params
    return chunk


def completion_chunk(request_id: str, model: str, created: int, text: str, token_ids: list[int] | None,
                     prompt_token_ids: list[int] | None, finish_reason: str | None, params: dict[str, Any] | None,
                     with_params: bool) -> dict[str, Any]:
    """A completions stream chunk (vLLM writes every choice field, nulls included)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
              "prompt_token_ids": prompt_token_ids, "token_ids": token_ids, "weight_versions": None}
    chunk: dict[str, Any] = {"id": request_id, "object": COMPLETION, "created": created, "model": model,
                             "choices": [choice]}
    if with_params:
        chunk["kv_transfer_params"] = params
    return chunk


def usage_chunk(request_id: str, model: str, created: int, kind: str, usage_obj: dict[str, Any]) -> dict[str, Any]:
    """The trailing usage chunk (``stream_options.include_usage``)."""
    return {"id": request_id, "object": CHAT_CHUNK if kind == "chat" else COMPLETION, "created": created,
            "model": model, "choices": [], "usage": usage_obj}
