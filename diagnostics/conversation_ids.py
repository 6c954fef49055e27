"""Conversation ids as routers log them: the id itself, or a sha256 tag of it (router ``--hash-ids``)."""

from __future__ import annotations

import hashlib
from typing import Final

HASH_PREFIX_LENGTHS: Final = (12, 16, 64)


def id_tags(conversation_id: str) -> list[str]:
    """The id itself and the hashed forms a router may log instead of it."""
    digest = hashlib.sha256(conversation_id.encode("utf-8", errors="replace")).hexdigest()
    return [conversation_id, *(digest[:n] for n in HASH_PREFIX_LENGTHS)]
