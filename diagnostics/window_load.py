"""The log lines P's stats windows need, read only when a turn waits for them (windows.py decides).

``explain --all`` keeps every request line already; it adds P's stat lines. One conversation's explain
has only that conversation's lines: it adds every proxy and engine line of the minutes around the
reads that wait for a window, so the other reads sharing those windows are counted too.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from typing import Final

from kvdiag.diagnostics.correlate import LogIndex
from kvdiag.diagnostics.detect import LogFile, LogReadError, open_binary
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log import PROXY_RE, parse_proxy_numbered, wall_clock
from kvdiag.diagnostics.scan import grep_ere, grep_lines, head_lines
from kvdiag.diagnostics.vllm_log import parse_vllm_numbered
from kvdiag.diagnostics.windows import LEAD_S, MAX_BLOCK, OPEN_READ_S, Ledger, ProxyRange, build_ledger

TAIL_BYTES: Final = 64 * 1024
HEAD_LIMIT: Final = 4 * 1024 * 1024  # P logs its configuration and first transfer plans near its start
STAT_KEYWORDS: Final = (b"KV Transfer metrics: ", b"Avg prompt throughput: ", b"Transfer plan: ", b"with config: ")
# Around the reads to decide: the lead a window needs to count as complete, and a run of windows of up
# to 30 s each on both sides.
SPAN_MARGIN_S: Final = LEAD_S + MAX_BLOCK * 30.0
# Engine lines worth parsing in a time span: the stat lines and every per-request kind windows.py reads.
_SPAN_KEEP: Final = re.compile(b"|".join(re.escape(k) for k in (
    *STAT_KEYWORDS, b"Declining expired", b"NIXL transfer failure", b"due to KV load failure", b"Skipping KV post",
    b"Skipping remote pull", b"calling _read_blocks", b"Finished recving", b"Got invalid KVTransferParams",
    b"Potentially invalid KV", b"Received request", b"Added request", b"Generated response")))


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


def ledger_for_index(index: LogIndex) -> Ledger | None:
    """``explain --all``: the index holds every request line; add P's stat lines and build the ledger."""
    extra = LogIndex(events=index.events, proxy=index.proxy, file_roles=index.file_roles, formats=index.formats,
                     vllm=list(index.vllm))
    stats = LineStats()
    for path in _engine_files(index):
        try:
            extra.vllm.extend(r for r in parse_vllm_numbered(grep_lines(path, STAT_KEYWORDS), path, stats)
                              if r.kind in ("engine_stats", "kv_metrics", "transfer_plan", "engine_config"))
        except LogReadError:
            return None
    log_range = proxy_range(p for p, fmt in index.formats.items() if fmt == "proxy")
    return build_ledger(extra, log_range) if log_range is not None else None


def _spans(times: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted((lo - SPAN_MARGIN_S, hi + SPAN_MARGIN_S) for lo, hi in times):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _prefixes(spans: list[tuple[float, float]], fmt: str) -> list[str]:
    """Timestamp prefixes at ten-second resolution covering the spans (``fmt``: a strftime format)."""
    out: dict[str, None] = {}
    for lo, hi in spans:
        t = lo - lo % 10
        while t <= hi:
            out[time.strftime(fmt, time.gmtime(t))[:-1]] = None
            t += 10
    return list(out)


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
    proxy_ere = "^(" + "|".join(re.escape(p) for p in _prefixes(spans, "%Y-%m-%d %H:%M:%S")) + ")"
    vllm_ere = " (DEBUG|INFO|WARNING|ERROR|CRITICAL) +(" + "|".join(
        re.escape(p) for p in _prefixes(spans, "%m-%d %H:%M:%S")) + ")"
    seen = {(r.path, r.lineno) for r in index.proxy}
    extra = LogIndex(events=index.events, file_roles=index.file_roles, formats=index.formats)
    stats = LineStats()
    engine_roles = ("prefill", "decode")
    head_keys = (b"Transfer plan: ", b"with config: ")
    for f in files:
        if f.fmt == "proxy":
            extra.proxy.extend(r for r in parse_proxy_numbered(grep_ere(f.path, proxy_ere), f.path, stats)
                               if (r.path, r.lineno) not in seen)
        elif f.fmt == "vllm" and index.file_roles.get(f.path) in engine_roles:
            lines = dict(ln for ln in grep_ere(f.path, vllm_ere) if _SPAN_KEEP.search(ln[1]))
            if index.file_roles.get(f.path) == "prefill":
                lines.update(head_lines(f.path, head_keys, HEAD_LIMIT))
            extra.vllm.extend(parse_vllm_numbered(sorted(lines.items()), f.path, stats))
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
