"""The base of every kvdiag domain error, so a library caller catches them in one place.

Each package raises its own subclass (a bad engine option, a bad router option, a malformed event,
...). A subclass may carry a ``hint``: the fix, which the CLI prints after the message.

Usage::

    try:
        turns = kvdiag.load_turns(["run/"])
    except kvdiag.KVDiagError as exc:
        print(exc, exc.hint or "")
"""

from __future__ import annotations

from typing import ClassVar


class KVDiagError(Exception):
    """A kvdiag domain error: the message names what is wrong, ``hint`` (optional) the fix."""

    # The class's default fix; an instance may give its own.
    default_hint: ClassVar[str | None] = None

    def __init__(self, *args: object, hint: str | None = None) -> None:
        super().__init__(*args)
        self.hint: str | None = hint if hint is not None else self.default_hint
