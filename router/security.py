"""Tenant scoping and id hashing.

* A conversation id is only meaningful inside its tenant (a hash of the bearer token), so one
  tenant can never name another tenant's handle: the store key hashes both together.
* ``--hash-ids`` replaces conversation ids in logs and events with :func:`hash_conversation_id`
  (the first 16 hex digits of sha256 over the UTF-8 id). ``kvdiag explain`` joins such events to
  client logs by hashing the client's ids the same way; events say so in ``attrs.id_hash``.
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any, Final

ANONYMOUS_TENANT: Final = "anonymous"
ID_HASH_SCHEME: Final = "sha256-16"  # recorded in events' attrs.id_hash when --hash-ids is on


def hash_conversation_id(conversation_id: str) -> str:
    """The stable public form of a conversation id: sha256 hex digest, first 16 characters."""
    return hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:16]


def loggable_as_is(conversation_id: str) -> bool:
    """True when the id can stand in a text log line as it is: it holds no whitespace and no control or
    format character. A newline in it would forge a line of its own, an escape sequence would drive the
    terminal that shows the log, a space would end the id where the proxy log's readers end it; such an id
    is logged as :func:`hash_conversation_id` of it, which ``kvdiag explain`` matches to the client's id."""
    return not any(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in conversation_id)


def tenant_of(authorization: str | None) -> str:
    """The tenant of a request: a hash of its bearer token (or ``anonymous`` without one)."""
    if not authorization:
        return ANONYMOUS_TENANT
    scheme, _, rest = authorization.strip().partition(" ")
    token = rest.strip() if scheme.lower() == "bearer" else authorization.strip()
    if not token:
        return ANONYMOUS_TENANT
    return "t-" + hashlib.sha256(b"kvdiag-tenant\x00" + token.encode("utf-8")).hexdigest()[:16]


def store_key(tenant: str, conversation_id: str) -> str:
    """The store key of a conversation within a tenant: fixed length, no client text in it."""
    t = tenant.encode("utf-8")
    raw = len(t).to_bytes(4, "big") + t + conversation_id.encode("utf-8")
    return hashlib.sha256(raw).hexdigest()[:32]


def earlier_turns(body: dict[str, Any]) -> int:
    """How many assistant replies the request carries (chat); 0 for completions."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
