"""Parser for the text log of vLLM's ``disagg_proxy_multiturn.py`` (its format: docs/vllm-reference.md).

Format ``%(asctime)s [%(levelname)s] %(name)s: %(message)s`` with ``%Y-%m-%d %H:%M:%S``; the
kvdiag router writes the same lines with ``--proxy-log``. Conversation ids appear as ``conv=%s``
(possibly a sha256 tag when the router hashes ids), request ids (the X-Request-Id sent to P and D)
as ``[%s]``.
"""

from __future__ import annotations

import calendar
import functools
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.diagnostics.linestats import LineStats, decode_line

PROXY_RE: Final = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[.,]\d+)? \[(?P<lvl>[A-Z]+)\] (?P<name>[\w.-]+): (?P<msg>.*)$")

_CONV: Final = r"(?P<conv>\S+?)"
CLASSIFIERS: Final[list[tuple[str, re.Pattern[str]]]] = [
    ("stale", re.compile(rf"^conv={_CONV}: stale cache entry \(age=(?P<age>[\d.]+)s > ttl=(?P<ttl>[\d.]+)s\)")),
    ("hit", re.compile(rf"^conv={_CONV}: cache HIT \(age=(?P<age>[\d.]+)s\)")),
    ("cached", re.compile(rf"^conv={_CONV}: cached D blocks \(remote_request_id=(?P<remote>[^,)]+), "
                          r"blocks=(?P<blocks>\d+)\)")),
    ("no_conversation_id", re.compile(r"^\[(?P<rid>[^\]]+)\] No conversation_id provided")),
    ("sending", re.compile(rf"^\[(?P<rid>[^\]]+)\] conv={_CONV}: sending D's cached blocks to P "
                           r"\(remote_request_id=(?P<remote>[^)]+)\)")),
    ("miss", re.compile(rf"^\[(?P<rid>[^\]]+)\] conv={_CONV}: cache MISS(?: \((?P<why>[^)]*)\))?")),
    # Later revisions of the example proxy check the history before offering or storing a handle.
    ("miss_head", re.compile(rf"^conv={_CONV}: cache MISS \((?P<why>[^)]*)\)")),
    ("not_cached", re.compile(rf"^\[(?P<rid>[^\]]+)\] (?:conv={_CONV}: )?not caching D blocks(?P<why>.*)$")),
    ("not_cached", re.compile(rf"^conv={_CONV}: not caching D blocks(?P<why>.*)$")),
    ("not_cached", re.compile(r"^not caching D blocks(?P<why>.*)$")),
    ("no_handle", re.compile(rf"^\[(?P<rid>[^\]]+)\] conv={_CONV}: no D-to-P handle offered")),
    ("prefill_done", re.compile(r"^\[(?P<rid>[^\]]+)\] Prefill done in (?P<ms>[\d.]+)ms")),
    ("prefill_failed", re.compile(r"^\[(?P<rid>[^\]]+)\] Prefill request failed: (?P<detail>.*)$")),
    ("decode_failed", re.compile(r"^\[(?P<rid>[^\]]+)\] Decode request failed: (?P<detail>.*)$")),
    ("ready", re.compile(r"^Ready: (?P<p>\d+) prefill, (?P<d>\d+) decode instances")),
]


@dataclass(slots=True)
class ProxyRecord:
    """One classified line of the proxy log."""

    path: str
    lineno: int
    ts: str
    level: str
    kind: str
    text: str
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """``file:line``."""
        return f"{self.path}:{self.lineno}"


@functools.lru_cache(maxsize=4096)
def _day_start(day: str) -> float:
    return float(calendar.timegm(time.strptime(day, "%Y-%m-%d")))


@functools.lru_cache(maxsize=65536)  # (a busy proxy logs dozens of lines a second, each with the same stamp)
def wall_clock(ts: str) -> float | None:
    """Seconds since the epoch of a proxy timestamp, read as written (no timezone is logged)."""
    try:
        return _day_start(ts[:10]) + int(ts[11:13]) * 3600 + int(ts[14:16]) * 60 + int(ts[17:19])
    except ValueError:
        return None


def _lead(regex: re.Pattern[str]) -> str:
    body = regex.pattern[1:]  # every classifier is anchored ("^")
    escaped = body.startswith("\\")
    lead = body[1] if escaped else body[0]
    if not (lead in "[]()" if escaped else lead.isalnum()):  # a class (\d, .) is no literal
        raise ValueError(f"proxy classifier {regex.pattern!r} must start with a literal character (dispatch key)")
    return lead


# Classifiers by the first character their message must start with ("c"onv=, "[", "R"eady): a line
# tries the two or three that can match, not all eleven. Order within a group is kept.
_BY_LEAD: Final[dict[str, list[tuple[str, re.Pattern[str]]]]] = {}
for _entry in CLASSIFIERS:
    _BY_LEAD.setdefault(_lead(_entry[1]), []).append(_entry)


def classify_proxy_message(msg: str) -> tuple[str | None, dict[str, Any]]:
    """Return (kind, fields) for a proxy message, or (None, {}) for one kvdiag does not use."""
    for kind, regex in _BY_LEAD.get(msg[:1], ()):
        m = regex.match(msg)
        if m:
            return kind, {k: v for k, v in m.groupdict().items() if v is not None}
    return None, {}


def is_proxy_line(text: str) -> bool:
    """True for a line in the proxy's log format (used by format detection)."""
    return PROXY_RE.match(text) is not None


def parse_proxy_log(lines: Iterable[bytes | str], path: str = "<stdin>",
                    stats: LineStats | None = None) -> Iterator[ProxyRecord]:
    """Yield the proxy records kvdiag uses; other lines are counted and skipped."""
    return parse_proxy_numbered(enumerate(lines, start=1), path, stats)


def parse_proxy_numbered(numbered: Iterable[tuple[int, bytes | str]], path: str = "<stdin>",
                         stats: LineStats | None = None) -> Iterator[ProxyRecord]:
    """Like parse_proxy_log over (line number, line) pairs."""
    stats = stats if stats is not None else LineStats()
    for lineno, raw in numbered:
        text, ok = decode_line(raw)
        if not ok:
            stats.corrupt += 1
            stats.note(path, lineno, "invalid UTF-8 or oversized line")
        text = text.rstrip("\r\n")
        if not text.strip():
            continue
        stats.lines += 1
        m = PROXY_RE.match(text)
        if m is None:
            stats.other += 1
            continue
        kind, fields = classify_proxy_message(m.group("msg"))
        if kind is None:
            stats.other += 1
            continue
        stats.records += 1
        yield ProxyRecord(path=path, lineno=lineno, ts=m.group("ts"), level=m.group("lvl"), kind=kind,
                          text=text[:500], fields=fields)
