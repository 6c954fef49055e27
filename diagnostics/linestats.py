"""Internal: line decoding and the per-file counters every parser shares (corrupt lines are counted, not fatal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

MAX_LINE_CHARS: Final = 1_000_000  # longer lines are truncated and counted as corrupt
MAX_NOTES: Final = 20


def decode_line(raw: bytes | str) -> tuple[str, bool]:
    """Return (text, ok): invalid UTF-8 is replaced and huge lines truncated, both reported as not ok."""
    if isinstance(raw, str):
        ok = len(raw) <= MAX_LINE_CHARS
        return (raw if ok else raw[:MAX_LINE_CHARS]), ok
    ok = len(raw) <= MAX_LINE_CHARS
    if not ok:
        raw = raw[:MAX_LINE_CHARS]
    try:
        return raw.decode("utf-8"), ok
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), False


@dataclass
class LineStats:
    """What a parser saw in one file: records, corrupt lines (skipped) and foreign lines (ignored)."""

    lines: int = 0
    records: int = 0
    corrupt: int = 0
    other: int = 0
    notes: list[str] = field(default_factory=list)
    unrecognised_files: list[str] = field(default_factory=list)  # inputs matching no known log format

    def note(self, path: str, lineno: int, what: str) -> None:
        """Keep the first few corrupt-line notes (``file:line: what``) for the report."""
        if len(self.notes) < MAX_NOTES:
            self.notes.append(f"{path}:{lineno}: {what}")

    def merge(self, other: LineStats) -> None:
        """Add another file's counts into this one."""
        self.lines += other.lines
        self.records += other.records
        self.corrupt += other.corrupt
        self.other += other.other
        self.notes.extend(other.notes[: max(0, MAX_NOTES - len(self.notes))])
        self.unrecognised_files.extend(other.unrecognised_files)
