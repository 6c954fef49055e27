"""Tenant scoping, id hashing and the prompt-prefix digest that guards handle injection.

* A conversation id is only meaningful inside its tenant (a hash of the bearer token), so one
  tenant can never name another tenant's handle: the store key hashes both together.
* ``--hash-ids`` replaces conversation ids in logs and events with :func:`hash_conversation_id`
  (the first 16 hex digits of sha256 over the UTF-8 id). ``kvdiag explain`` joins such events to
  client logs by hashing the client's ids the same way; events say so in ``attrs.id_hash``.
* A handle covers D's sequence (the turn's prompt plus the reply). The router keeps a digest of the
  prompt it sent; the next turn's prompt must start with exactly that prompt, or P would read KV
  computed for other tokens (vLLM issue #43094: stripped reasoning, edited history).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

ANONYMOUS_TENANT: Final = "anonymous"
ID_HASH_SCHEME: Final = "sha256-16"  # recorded in events' attrs.id_hash when --hash-ids is on


def hash_conversation_id(conversation_id: str) -> str:
    """The stable public form of a conversation id: sha256 hex digest, first 16 characters."""
    return hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:16]


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


@dataclass(frozen=True)
class PromptPrefix:
    """What a handle's prompt was: its length (messages or characters/tokens) and digest."""

    kind: str  # "messages" or "prompt"
    length: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form kept in the store."""
        return {"kind": self.kind, "length": self.length, "digest": self.digest}

    @classmethod
    def from_dict(cls, obj: Any) -> PromptPrefix | None:
        """Parse the stored form; None when absent or malformed (the handle is then not trusted)."""
        if not isinstance(obj, dict):
            return None
        kind, length, digest = obj.get("kind"), obj.get("length"), obj.get("digest")
        if kind not in ("messages", "prompt") or not isinstance(length, int) or not isinstance(digest, str):
            return None
        return cls(kind, length, digest)


def _feed_message(h: Any, message: Any) -> None:
    # Fast path for the common {"role", "content": str} message; anything else is canonical JSON.
    if isinstance(message, dict) and len(message) <= 2 and isinstance(message.get("content"), str) \
            and isinstance(message.get("role"), str) and set(message) <= {"role", "content"}:
        h.update(message["role"].encode("utf-8"))
        h.update(b"\x1f")
        h.update(message["content"].encode("utf-8", "surrogatepass"))
    else:
        h.update(b"\x1d")
        h.update(json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                 .encode("utf-8", "surrogatepass"))
    h.update(b"\x1e")


def _prompt_text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))


@dataclass(frozen=True)
class PrefixCheck:
    """The digest of this request's whole prompt, and whether it extends a stored prefix."""

    prefix: PromptPrefix
    extends: bool | None  # None when no stored prefix was given


def check_prefix(body: dict[str, Any], stored: PromptPrefix | None) -> PrefixCheck:
    """Digest the request's prompt and test it against ``stored`` in one pass.

    Chat: the first ``stored.length`` messages must hash to ``stored.digest``. Completions: the
    prompt text must start with the stored prompt (same length and digest of that slice).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        h = hashlib.sha256()
        extends: bool | None = None if stored is None else False
        if stored is not None and stored.kind == "messages" and stored.length == 0:
            extends = h.hexdigest() == stored.digest
        for i, message in enumerate(messages, start=1):
            _feed_message(h, message)
            if stored is not None and stored.kind == "messages" and i == stored.length:
                extends = h.hexdigest() == stored.digest
        return PrefixCheck(PromptPrefix("messages", len(messages), h.hexdigest()), extends)
    text = _prompt_text(body.get("prompt", ""))
    data = text.encode("utf-8", "surrogatepass")
    extends = None
    if stored is not None:
        extends = (stored.kind == "prompt" and len(data) >= stored.length
                   and hashlib.sha256(data[:stored.length]).hexdigest() == stored.digest)
    return PrefixCheck(PromptPrefix("prompt", len(data), hashlib.sha256(data).hexdigest()), extends)


def earlier_turns(body: dict[str, Any]) -> int:
    """How many assistant replies the request carries (chat); 0 for completions."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
