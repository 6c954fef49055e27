"""kvdiag: observability and diagnostics for vLLM P/D disaggregation with bidirectional KV transfer.

The public face, for a library user::

    import kvdiag

    conv = kvdiag.explain_conversation(["logs/"], "c1")   # one conversation's turns and verdicts
    table = kvdiag.load_turn_table(["logs/"])             # every turn, one row each (pandas)
    print(kvdiag.build_report(table).summary)             # the aggregated report

The functions load their modules on first use, so ``import kvdiag`` stays cheap. Everything else lives in
the subpackages (``kvdiag.sim``, ``kvdiag.router``, ``kvdiag.diagnostics``, ...); modules whose docstring
starts with "Internal" are not part of the public API.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.events import EventFormatError, PrefillReport, TurnEvent, parse_event, read_events
from kvdiag.schema.verdicts import Confidence, Verdict

if TYPE_CHECKING:
    from kvdiag.diagnostics.advise import advise
    from kvdiag.diagnostics.report import build_report, load_turn_table
    from kvdiag.diagnostics.turn_loader import explain_conversation, load_turns

__version__ = "0.1.0"

# name -> the module that defines it, imported on first access (PEP 562).
_LAZY = {
    "load_turns": "kvdiag.diagnostics.turn_loader",
    "explain_conversation": "kvdiag.diagnostics.turn_loader",
    "load_turn_table": "kvdiag.diagnostics.report",
    "build_report": "kvdiag.diagnostics.report",
    "advise": "kvdiag.diagnostics.advise",
}

__all__ = (
    "Confidence",
    "EventFormatError",
    "KVDiagError",
    "PrefillReport",
    "TurnEvent",
    "Verdict",
    "__version__",
    "advise",
    "build_report",
    "explain_conversation",
    "load_turn_table",
    "load_turns",
    "parse_event",
    "read_events",
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvdiag' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
