"""Internal: the log lines P's stats windows need, read only when a turn waits for them (windows.py decides).

``explain --all`` keeps every request line already; it adds P's stat lines. One conversation's explain
has only that conversation's lines: it adds every proxy and engine line of the minutes around the
reads that wait for a window, so the other reads sharing those windows are counted too.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final

from kvdiag.diagnostics.detect import LogFile, LogReadError, open_binary
from kvdiag.diagnostics.engine_proxy import longest_literal
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log_parser import CLASSIFIERS, PROXY_RE, parse_proxy_numbered, wall_clock
from kvdiag.diagnostics.scan import count_newlines, grep_ere, grep_ere_in, grep_lines, head_lines
from kvdiag.diagnostics.vllm_log_parser import VllmRecord, parse_vllm_numbered
from kvdiag.diagnostics.windows import (
    LEAD_S,
    MAX_BLOCK,
    OFFER_KINDS,
    OPEN_READ_S,
    Ledger,
    LogIndex,
    ProxyRange,
    build_ledger,
    clock_offset,
    vllm_wall_clock,
)

TAIL_BYTES: Final = 64 * 1024
HEAD_LIMIT: Final = 4 * 1024 * 1024  # P logs its configuration and first transfer plans near its start
STAT_KEYWORDS: Final = (b"KV Transfer metrics: ", b"Avg prompt throughput: ", b"Transfer plan: ", b"with config: ")
# P's lines kept from a time span: the stat lines and every per-request kind windows.py reads (D's lines
# only tell which of the other reads succeeded, which the windows do not need to know).
# Around the reads to decide: the lead a window needs to count as complete, and a run of windows of up
# to 30 s each on both sides.
SPAN_MARGIN_S: Final = LEAD_S + MAX_BLOCK * 30.0
_SPAN_KEEP_WORDS: Final = (
    *STAT_KEYWORDS, b"Declining expired", b"NIXL transfer failure", b"due to KV load failure", b"Skipping KV post",
    b"Skipping remote pull", b"calling _read_blocks", b"Finished recving", b"Got invalid KVTransferParams",
    b"Potentially invalid KV", b"Received request", b"Added request", b"Generated response")
_SPAN_KEEP: Final = re.compile(b"|".join(re.escape(k) for k in _SPAN_KEEP_WORDS))


def _engine_files(index: LogIndex, roles: tuple[str, ...] = ("prefill",)) -> list[str]:
    return [p for p, fmt in index.formats.items() if fmt == "vllm" and index.file_roles.get(p) in roles]


def proxy_range(paths: Iterable[str]) -> ProxyRange | None:
    """The first and last timestamps of the proxy log files (their head and tail lines)."""
    first: tuple[float, bool] | None = None
    last: float | None = None
    for path in paths:
        with open_binary(path) as fh:
            head = fh.read(TAIL_BYTES)
            tail = head
            if not path.endswith(".gz"):
                size = fh.seek(0, 2)
                fh.seek(max(0, size - TAIL_BYTES))
                tail = fh.read(TAIL_BYTES)
            else:  # a rotated .gz: decompress to its end
                while block := fh.read(1 << 20):
                    tail = (tail + block)[-TAIL_BYTES:]
        stamps = [(t, m.group("msg")) for t, m in _proxy_lines(head)]
        if stamps and (first is None or stamps[0][0] < first[0]):
            first = (stamps[0][0], stamps[0][1].startswith("Ready: "))
        ends = [t for t, _ in _proxy_lines(tail)]
        if ends and (last is None or ends[-1] > last):
            last = ends[-1]
    if first is None or last is None:
        return None
    return ProxyRange(first=first[0], last=last, fresh=first[1])


def _proxy_lines(data: bytes) -> Iterator[tuple[float, re.Match[str]]]:
    for raw in data.split(b"\n"):
        m = PROXY_RE.match(raw.decode("utf-8", errors="replace").rstrip("\r"))
        t = wall_clock(m.group("ts")) if m else None
        if m and t is not None:
            yield t, m


def ledger_for_index(index: LogIndex, ref: float | None = None) -> Ledger | None:
    """``explain --all``: the index holds every request line (``ref``: build_ledger's); add P's stat lines and
    build the ledger."""
    extra = LogIndex(events=index.events, proxy=index.proxy, file_roles=index.file_roles, formats=index.formats,
                     vllm=list(index.vllm))
    stats = LineStats()
    sent = [t for t in (wall_clock(r.ts) for r in index.proxy if r.kind == "sending") if t is not None]
    if not sent or not all(_periodic(_probe(path, sorted(sent)[len(sent) // 2])) for path in _engine_files(index)):
        return None  # stat lines several a second mark no windows (docs/verdicts.md)
    for path in _engine_files(index):
        try:
            lines = list(grep_lines(path, STAT_KEYWORDS))
        except LogReadError:
            return None
        extra.vllm.extend(r for r in parse_vllm_numbered(lines, path, stats)
                          if r.kind in ("engine_stats", "kv_metrics", "transfer_plan", "engine_config"))
    log_range = proxy_range(p for p, fmt in index.formats.items() if fmt == "proxy")
    return build_ledger(extra, log_range, ref=ref) if log_range is not None else None


def _spans(times: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted((lo - SPAN_MARGIN_S, hi + SPAN_MARGIN_S) for lo, hi in times):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def span_patterns(spans: list[tuple[float, float]], p_spans: list[tuple[float, float]] | None = None
                  ) -> tuple[str, str]:
    """The searches for the spans' lines (POSIX extended regexes rg and Python read the same way): the proxy's
    lines stamped in a span, and P's lines stamped in a span of ``p_spans`` (the same spans on P's clock; default
    ``spans``) that hold a kind the ledger reads (found together by the search, so the rest, most of a busy
    engine's lines, never reach Python; _SPAN_KEEP still decides)."""
    # (the proxy's stamp may have "T" between the date and the time, as an ISO-minded logging setup writes it)
    proxy = "^(" + "|".join(_ere(p[:10]) + "[ T]" + _ere(p[11:]) for p in _prefixes(spans, "%Y-%m-%d %H:%M:%S")) + ")"
    ansi = "(\x1b\\[[0-9;]*m)*"
    p_spans = spans if p_spans is None else p_spans
    stamped = f" {ansi}(DEBUG|INFO|WARNING|ERROR|CRITICAL){ansi} +{ansi}(" + "|".join(
        _ere(p) for p in _prefixes(p_spans, "%m-%d %H:%M:%S")) + ")"
    kinds = "(" + "|".join(_ere(k.decode()) for k in _SPAN_KEEP_WORDS) + ")"
    return proxy, f"{stamped}.*{kinds}|{kinds}.*{stamped}"


def _ere(literal: str) -> str:
    """A literal for a POSIX extended regex that Python's ``re`` reads the same way."""
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", literal)


def _prefixes(spans: list[tuple[float, float]], fmt: str) -> list[str]:
    """Timestamp prefixes at ten-second resolution covering the spans (``fmt``: a strftime format)."""
    out: dict[str, None] = {}
    for lo, hi in spans:
        t = lo - lo % 10
        while t <= hi:
            out[time.strftime(fmt, time.gmtime(t))[:-1]] = None
            t += 10
    return list(out)


_A: Final = rb"(?:\x1b\[[0-9;]*m)*"  # vLLM's colours when its output was a terminal
_ENGINE_TICK: Final = re.compile(rb" " + _A + rb"(?:INFO|DEBUG)" + _A + rb" +" + _A + rb"(\d\d-\d\d \d\d:\d\d:\d\d)"
                                 + _A + rb" " + _A + rb"\[[^\]]*\]" + _A + rb" Engine (\d+): Avg prompt")


def _periodic(lines: Iterable[bytes]) -> bool:
    """At most one Engine line per engine and second, as vLLM's periodic stat logger writes them, but for one
    repeated line (a log shipper's retry) or one in twenty: the minute's few lines hold no more evidence, and
    the windows' own check reads the whole stream."""
    ticks: dict[bytes, list[bytes]] = {}
    for line in lines:
        m = _ENGINE_TICK.search(line)
        if m:
            ticks.setdefault(m.group(2), []).append(m.group(1))
    for stamps in ticks.values():
        repeats = len(stamps) - len(set(stamps))
        if repeats > max(1.0, 0.05 * len(stamps)):
            return False
    return True


_STAMP: Final = re.compile(rb" " + _A + rb"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)" + _A + rb" +" + _A
                           + rb"(\d\d-\d\d \d\d:\d\d:\d\d)" + _A + rb" " + _A + rb"\[")
PROBE_RADIUS_S: Final = 30.0
PROBE_BYTES: Final = 8 * 1024 * 1024


def _probe(path: str, center: float) -> list[bytes]:
    """The Engine stat lines of a (time-ordered) vLLM log within PROBE_RADIUS_S of ``center``, found by bisecting
    byte offsets on the lines' timestamps; every such line for a compressed file (it cannot be bisected)."""
    if path.endswith(".gz"):
        return [ln for _, ln in grep_lines(path, [b"Avg prompt throughput: "])]
    with _mapped(path) as mm:
        return [] if mm is None else _probe_ticks(mm, center)


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[mmap.mmap | None]:
    """The file mapped for reading (None when it is empty)."""
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise LogReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    with fh:
        if fh.seek(0, 2) == 0:
            yield None
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            yield mm


_TICK_MARK: Final = b": Avg prompt"  # (in every line _ENGINE_TICK matches)


def _probe_ticks(mm: mmap.mmap | bytes, center: float) -> list[bytes]:
    """From the line where the minute starts (bisected), up to PROBE_BYTES, the lines holding an Engine stat, up
    to the first whose (first) stamp is past the minute. Only those lines are read: a minute of a busy P's log
    is megabytes, and a regular expression over all of it cost more than the rest of a conversation's look."""
    clock: dict[bytes, float | None] = {}  # (a second's lines share its stamp: each is read once)

    def wall(stamp: bytes) -> float | None:
        if stamp not in clock:
            clock[stamp] = vllm_wall_clock(stamp.decode(), center)
        return clock[stamp]

    start = _probe_start(mm, center, wall)
    limit = min(len(mm), start + PROBE_BYTES)
    out = []
    at = mm.find(_TICK_MARK, start, limit)
    while at >= 0:
        begin = mm.rfind(b"\n", start, at) + 1 or start
        end = mm.find(b"\n", at, limit)
        line = mm[begin:limit if end < 0 else end]
        m = _STAMP.search(line)
        t = wall(m.group(1)) if m else None
        if t is not None and t > center + PROBE_RADIUS_S:
            break
        out.append(line)
        if end < 0:
            break
        at = mm.find(_TICK_MARK, end, limit)
    return out


def _probe_start(mm: mmap.mmap | bytes, center: float, wall: Callable[[bytes], float | None]) -> int:
    """Where the line starts from which the minute before ``center`` is read, ``wall`` reading a stamp's text
    as a time."""
    lo, _hi = _bracket(mm, center - PROBE_RADIUS_S, wall)
    return mm.rfind(b"\n", 0, lo) + 1


_BISECT_BYTES: Final = 65536  # (a stamp is looked for this far after each offset tried)


def _bracket(mm: mmap.mmap | bytes, target: float, wall: Callable[[bytes], float | None], *, past: bool = False
             ) -> tuple[int, int]:
    """Offsets ``lo <= hi``, at most _BISECT_BYTES apart, bisected on the stamps of a log written in time order:
    the first stamp at or after ``lo`` comes before ``target`` (or ``lo`` is 0), and none from ``hi +
    _BISECT_BYTES`` on does (``past``: comes at or before it, and none after does)."""
    size = len(mm)
    lo, hi = 0, size
    while hi - lo > _BISECT_BYTES:
        mid = (lo + hi) // 2
        m = _STAMP.search(mm, mid, min(size, mid + _BISECT_BYTES))
        t = wall(m.group(1)) if m else None
        if t is None or t > target or (t == target and not past):
            hi = mid
        else:
            lo = mid
    return lo, hi


# How far out of time order P's log may hold a line (several processes write it, each in its own order).
SPAN_SLACK_S: Final = 60.0


def _span_lines(path: str, spans: list[tuple[float, float]], ere: str, known: Sequence[VllmRecord] = ()
                ) -> list[tuple[int, bytes]]:
    """The lines of P's log that ``ere`` (a search stamped in the spans) matches, numbered as grep numbers them:
    the log is written in time order, so only the bytes that can hold the spans' stamps (bisected, with
    SPAN_SLACK_S and the stamps' 10-second buckets around them) are searched, not the whole file. ``known``:
    records of this file already numbered by a whole-file search; one found in those bytes numbers them without
    counting the lines before them."""
    if path.endswith(".gz"):
        return list(grep_ere(path, ere, rg_reads_it=True))
    first, last = min(lo for lo, _ in spans) - 10 - SPAN_SLACK_S, max(hi for _, hi in spans) + 10 + SPAN_SLACK_S
    clock: dict[bytes, float | None] = {}

    def wall(stamp: bytes) -> float | None:
        if stamp not in clock:
            clock[stamp] = vllm_wall_clock(stamp.decode(), first)
        return clock[stamp]

    with _mapped(path) as mm:
        if mm is None:
            return []
        lo, _hi = _bracket(mm, first, wall)
        start = mm.rfind(b"\n", 0, lo) + 1
        end = len(mm)
        # up to the first line stamped past the spans, from the bracket's start (a stretch without stamps, a long
        # traceback, does not end them)
        for m in _STAMP.finditer(mm, max(start, _bracket(mm, last, wall, past=True)[0])):
            t = wall(m.group(1))
            if t is not None and t > last:
                end = mm.rfind(b"\n", 0, m.start()) + 1
                break
        data = mm[start:end]
        before = _lines_before(data, known)
        if before is None:
            before = count_newlines(mm, 0, start)
    return grep_ere_in(data, ere, before + 1, name=path, rg_reads_it=True)


def _lines_before(data: bytes, known: Sequence[VllmRecord]) -> int | None:
    """How many lines of the file come before ``data`` (bytes from a line's start), read off a record of
    ``known`` (numbered by a whole-file search) whose line ``data`` holds: its stamp and whole first line, found
    once in ``data`` and on no other record. None when there is none: the caller counts the lines instead (on a
    busy P that is hundreds of megabytes, the larger part of a conversation's look at its stats windows)."""
    by_text: dict[tuple[bytes, bytes], list[VllmRecord]] = {}
    for r in known:
        head = r.msg.split("\n", 1)[0].encode("utf-8", errors="surrogateescape")
        if len(head) >= _ANCHOR_MIN:
            by_text.setdefault((r.ts.encode(), head), []).append(r)
    for (stamp, head), records in by_text.items():
        if len(records) != 1:
            continue  # (two records, one text: either may be the line found)
        at = data.find(head)
        if at < 0 or data.find(head, at + 1) >= 0:
            continue
        begin = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        line = data[begin:end if end >= 0 else len(data)].rstrip(b"\r")
        if line.endswith(head) and stamp in line[:len(line) - len(head)]:
            return records[0].lineno - 1 - data.count(b"\n", 0, begin)
    return None


_ANCHOR_MIN: Final = 24  # bytes of a record's first line that make it its own (a request id is 32 or more)


# a proxy line of a kind the ledger reads holds its pattern's longest literal
_OFFER_MARKER: Final = re.compile(b"|".join(sorted({re.escape(longest_literal(regex).encode())
                                                    for kind, regex in CLASSIFIERS if kind in OFFER_KINDS})))


def ledger_for_conversation(files: list[LogFile], index: LogIndex, wanted: set[str]) -> Ledger | None:
    """One conversation: read every proxy and engine line near the reads in ``wanted`` and build the ledger."""
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    for rec in index.proxy:
        rid = rec.fields.get("rid")
        t = wall_clock(rec.ts)
        if rid in wanted and t is not None:
            starts[rid] = min(starts.get(rid, t), t)
            ends[rid] = max(ends.get(rid, t), t)
    if not starts:
        return None
    spans = _spans((starts[r], max(ends[r], starts[r]) + (0 if ends[r] > starts[r] else OPEN_READ_S)) for r in starts)
    # P's log is read at P's own times: where its clock is off the proxy's (another time zone, say), the offset
    # its lines naming this conversation's requests give, as build_ledger measures it on every line it is given
    offset = clock_offset(index)
    p_spans = [(lo + offset, hi + offset) for lo, hi in spans]
    proxy_ere, vllm_ere = span_patterns(spans, p_spans)
    seen = {(r.path, r.lineno) for r in index.proxy}
    extra = LogIndex(events=index.events, file_roles=index.file_roles, formats=index.formats)
    stats = LineStats()
    center = min(starts.values()) + offset
    # Stat lines several a second mark no windows: a look at the minute around the first read (a few
    # reads of P's log at bisected offsets) spares reading the rest.
    if not all(_periodic(_probe(path, center)) for path in _engine_files(index)):
        return None
    p_lines: dict[str, dict[int, bytes]] = {}
    for path in _engine_files(index):
        numbered = [r for r in index.vllm if r.path == path]
        p_lines[path] = dict(ln for ln in _span_lines(path, p_spans, vllm_ere, numbered) if _SPAN_KEEP.search(ln[1]))
    for path, lines in p_lines.items():
        lines.update(head_lines(path, (b"Transfer plan: ", b"with config: "), HEAD_LIMIT))
        extra.vllm.extend(parse_vllm_numbered(sorted(lines.items()), path, stats))
    for f in files:
        if f.fmt == "proxy":
            # (only the kinds the ledger reads are parsed: its year reference for P's stamps is then the earliest
            # of those and of the conversation's own lines, minutes from the earliest line of any kind)
            offers = ((n, ln) for n, ln in grep_ere(f.path, proxy_ere, rg_reads_it=True) if _OFFER_MARKER.search(ln))
            extra.proxy.extend(r for r in parse_proxy_numbered(offers, f.path, stats) if (r.path, r.lineno) not in seen)
    if not any(r.kind == "transfer_plan" for r in extra.vllm):  # logged at P's first read from each D
        for path in _engine_files(index):
            extra.vllm.extend(r for r in parse_vllm_numbered(grep_lines(path, [b"Transfer plan: "]), path, stats)
                              if r.kind == "transfer_plan")
    known = {(r.path, r.lineno) for r in extra.vllm}
    extra.vllm.extend(r for r in index.vllm if (r.path, r.lineno) not in known)
    order = {f.path: i for i, f in enumerate(files)}
    extra.proxy = sorted([*index.proxy, *extra.proxy], key=lambda r: (order.get(r.path, 0), r.lineno))
    log_range = proxy_range(f.path for f in files if f.fmt == "proxy")
    return build_ledger(extra, log_range, spans=spans) if log_range is not None else None
