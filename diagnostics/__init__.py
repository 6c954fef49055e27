"""Log parsers, the correlator and the verdict classifier behind explain, report and advise.

Entry points: :func:`load_turns` (every conversation) and :func:`explain_conversation` (one).
"""

from kvdiag.diagnostics.turn_loader import (
    ConversationNotFoundError,
    ExplainError,
    UnreadableLogError,
    explain_conversation,
    load_turns,
)

__all__ = ["ConversationNotFoundError", "ExplainError", "UnreadableLogError", "explain_conversation", "load_turns"]
