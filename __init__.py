"""kvdiag: observability and diagnostics for vLLM P/D disaggregation with bidirectional KV transfer.

The public facade is small on purpose; everything else lives in the subpackages
(``kvdiag.sim``, ``kvdiag.router``, ``kvdiag.diagnostics``, ``kvdiag.exporters``, ...).
"""

from kvdiag.schema.events import EventFormatError, PrefillReport, TurnEvent, parse_event, read_events
from kvdiag.schema.verdicts import Confidence, Verdict

__version__ = "0.1.0"

__all__ = (
    "Confidence",
    "EventFormatError",
    "PrefillReport",
    "TurnEvent",
    "Verdict",
    "__version__",
    "parse_event",
    "read_events",
)
