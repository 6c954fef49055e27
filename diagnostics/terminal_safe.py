"""Text from logs, printed to a terminal without the terminal obeying it.

Conversation ids come from clients, evidence lines are raw log lines and file names are whatever the
folder holds: any of them can carry an escape sequence (set the window title, clear the screen, rewrite
what was printed before) or a carriage return that overwrites a line. Every console kvdiag prints on
shows such characters as U+FFFD instead; the styles kvdiag itself asks for are untouched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Final

from rich.console import Console, ConsoleOptions, RenderableType, RenderHook
from rich.segment import Segment

# C0 controls but tab and newline (rich lays those out itself), DEL and the C1 controls (\x9b opens a
# sequence as ESC [ does)
_CONTROL: Final = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
SHOWN_AS: Final = "\ufffd"


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline shown as U+FFFD."""
    return _CONTROL.sub(SHOWN_AS, text)


class _Shown:
    """A renderable whose text segments are made printable once laid out (rich counts a control character as
    no cell, so a row holding one is one cell wider per character: the text is safe, if not aligned)."""

    def __init__(self, inner: RenderableType) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Segment]:
        for seg in console.render(self.inner, options):
            yield seg if seg.control or not _CONTROL.search(seg.text) else Segment(printable(seg.text), seg.style)


class _ShowControls(RenderHook):
    def process_renderables(self, renderables: list[Any]) -> list[Any]:
        return [_Shown(r) for r in renderables]


def safe_console(**kwargs: Any) -> Console:
    """A rich Console (``kwargs`` as Console's) that prints control characters in text as U+FFFD."""
    console = Console(**kwargs)
    console.push_render_hook(_ShowControls())
    return console
