"""Log parsers, the correlator and the verdict classifier behind explain, report and advise.

Entry points: :func:`load_turns` (every conversation) and :func:`explain_conversation` (one). They load
their module on first use, so importing one small module of this package (the terminal helpers, say)
does not load the engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdiag.diagnostics.turn_loader import (
        ConversationNotFoundError,
        ExplainError,
        UnreadableLogError,
        explain_conversation,
        load_turns,
    )

__all__ = ["ConversationNotFoundError", "ExplainError", "UnreadableLogError", "explain_conversation", "load_turns"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvdiag.diagnostics' has no attribute {name!r}")
    value = getattr(import_module("kvdiag.diagnostics.turn_loader"), name)
    globals()[name] = value
    return value
