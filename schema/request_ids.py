"""vLLM's request ids and the X-Request-Id behind them, in one place for every emitter and reader.

vLLM's OpenAI server turns the client's ``X-Request-Id: <id>`` into the external id
``chatcmpl-<id>`` (``cmpl-<id>`` for completions) and the engine's internal id
``<external>-<8 random alphanumerics>``; the internal id is what the engine, its logs and
``remote_request_id`` in kv_transfer_params carry.

Usage::

    external, internal = vllm_request_ids("conv1-t2", "chat")   # chatcmpl-conv1-t2, chatcmpl-conv1-t2-1a2b3c4d
    assert header_request_id(internal) == "conv1-t2"
"""

from __future__ import annotations

import re
import uuid
from typing import Final

# The longest X-Request-Id kept as given (client-supplied: bounds what reaches logs and params).
MAX_HEADER_ID: Final = 256
_SUFFIX_RE: Final = re.compile(r"[0-9a-zA-Z]{8}")
_PREFIXES: Final = ("chatcmpl-", "cmpl-")


def vllm_request_ids(header: str | None, kind: str) -> tuple[str, str]:
    """The external and internal ids vLLM gives a request (``kind`` "chat" or "completion").

    A header longer than ``MAX_HEADER_ID`` characters is cut; no header gives a random uuid hex.
    """
    base = header[:MAX_HEADER_ID] if header else uuid.uuid4().hex
    external = ("chatcmpl-" if kind == "chat" else "cmpl-") + base
    return external, f"{external}-{uuid.uuid4().hex[:8]}"


def external_id(request_id: str) -> str:
    """vLLM's external id: the internal id without its ``-<8 chars>`` randomisation suffix."""
    if len(request_id) > 9 and request_id[-9] == "-" and _SUFFIX_RE.fullmatch(request_id, len(request_id) - 8):
        return request_id[:-9]
    return request_id


def header_request_id(request_id: str) -> str:
    """The X-Request-Id behind an engine id: drop the ``chatcmpl-``/``cmpl-`` prefix and the suffix."""
    ext = external_id(request_id)
    for prefix in _PREFIXES:
        if ext.startswith(prefix):
            return ext[len(prefix):]
    return ext
