"""P's periodic stat lines against the D→P reads the proxy offered: what each stats window proves at INFO.

At INFO vLLM logs nothing per request for a D→P read that worked, was skipped under the threshold or
found P's own prefix cache full. Every ``VLLM_LOG_STATS_INTERVAL`` (10 s) P's API server logs, for the
interval that just ended:

* ``Engine 000: Avg prompt throughput: ...``: always (at DEBUG when the engine was idle two intervals in
  a row). ``Prefix cache hit rate`` appears only when prefix caching is on. ``External prefix cache hit
  rate`` aggregates the last 1000 requests, not the interval, so it decides nothing per turn.
* ``KV Transfer metrics: Num successful transfers=N, ...``: right after it, only when the interval saw a
  transfer, a failure or an expiry; no such line means none of them.

P starts every D→P read (D counts the P→D ones), so N is P's successful D→P reads times the NIXL
transfers one read makes (the ``Transfer plan:`` line: P's TP ranks times the D ranks each reads).
With the times the proxy offered each handle (``sending D's cached blocks``, then ``Prefill done``), a
run of windows whose successes equal the reads that can fall in it proves each of those reads
succeeded; windows with no success prove that the reads which can only fall in them read nothing.
Anything in between stays undecided, naming the reads that share the windows.
"""

from __future__ import annotations

import bisect
import calendar
import functools
import itertools
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from kvdiag.diagnostics.detect import rotation_base
from kvdiag.diagnostics.json_logs import EventRecord
from kvdiag.diagnostics.proxy_log_parser import ProxyRecord, wall_clock
from kvdiag.diagnostics.vllm_log_parser import VllmRecord
from kvdiag.schema.request_ids import header_request_id
from kvdiag.schema.verdicts import Verdict

CLOCK_SLACK_S: Final = 1.0  # the proxy's and P's clocks may differ by this much (both log whole seconds)
MAX_BLOCK: Final = 6  # windows combined when looking for a run whose counts account for every read
OPEN_READ_S: Final = 600.0  # a read with no later line of its request could end this late
LEAD_S: Final = 60.0  # reads sent before the proxy log starts may still land in its first minute
PROBLEM_RADIUS_S: Final = 120.0  # a window no offered read explains stops decisions this close to it
_NO_READ_KINDS: Final = frozenset({"declining_expired", "nixl_failure", "kv_load_failed", "skip_remote_pull",
                                   "skip_post_processing"})
_READ_KINDS: Final = frozenset({"read_blocks", "finished_recving"})
_EVENT_NO_READ: Final = frozenset(v.value for v in (
    Verdict.LOCAL_HIT, Verdict.BELOW_THRESHOLD, Verdict.TRANSFER_FAILED, Verdict.FEATURE_DISABLED_ON_PREFILL,
    Verdict.PREFIX_MISMATCH))


@dataclass
class LogIndex:
    """The records the stats windows read: P's and D's lines, the proxy's, P's events, and each file's role."""

    events: list[EventRecord] = field(default_factory=list)
    proxy: list[ProxyRecord] = field(default_factory=list)
    vllm: list[VllmRecord] = field(default_factory=list)
    file_roles: dict[str, str | None] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # path -> format


def record_rids(rec: VllmRecord) -> list[str]:
    """The request ids a vLLM record names (its own, a failed batch's, a NIXL context's)."""
    f = rec.fields
    rids = [f["request_id"]] if isinstance(f.get("request_id"), str) else []
    rids += [r for r in f.get("request_ids", []) if isinstance(r, str)]
    ctx = f.get("context")
    if isinstance(ctx, dict) and isinstance(ctx.get("request_id"), str):
        rids.append(ctx["request_id"])
    return rids


@functools.lru_cache(maxsize=1024)
def _day(year: int, month_day: str) -> float:
    return float(calendar.timegm(time.strptime(f"{year}-{month_day}", "%Y-%m-%d")))


def vllm_wall_clock(ts: str, ref: float) -> float | None:
    """Seconds since the epoch of a vLLM timestamp (``MM-DD HH:MM:SS``, no year), the year nearest ``ref``."""
    try:
        secs = int(ts[6:8]) * 3600 + int(ts[9:11]) * 60 + int(ts[12:14])
        year = time.gmtime(ref).tm_year
        options = [_day(y, ts[:5]) + secs for y in (year - 1, year, year + 1)]
    except ValueError:
        return None
    return min(options, key=lambda t: abs(t - ref))


@dataclass(slots=True)
class StatWindow:
    """One stats interval of one P engine: (lo, hi) bounds the interval on P's clock, in seconds."""

    stream: str
    lo: float
    hi: float
    successes: int
    line: VllmRecord  # the Engine line
    kv_line: VllmRecord | None
    complete: bool = True  # every read that can fall in it is in the proxy log given

    @property
    def evidence(self) -> VllmRecord:
        """The line that states the window's count: the KV Transfer metrics line, else the Engine line."""
        return self.kv_line or self.line


@dataclass(slots=True)
class Offer:
    """A handle the proxy offered P: when (proxy clock, seconds) and what P's lines say of the read."""

    rid: str
    conv: str | None
    lo: float
    hi: float
    sent: ProxyRecord
    counted: bool | None = None  # True: a read P counted; False: known to make no successful transfer
    rejected: VllmRecord | None = None  # P's "Got invalid KVTransferParams" line for this handle


@dataclass(frozen=True)
class WindowFinding:
    """What P's stats windows say about one offered read."""

    read: bool | None  # True: it succeeded; False: no successful transfer; None: the windows cannot tell
    windows: tuple[StatWindow, ...]
    peers: tuple[Offer, ...]
    why: str
    prefix_caching: bool | None
    rejected: VllmRecord | None = None  # P refused the params themselves: no rule applies


@dataclass
class _Stream:
    name: str
    group: str
    lines: list[tuple[float, VllmRecord, VllmRecord | None]] = field(default_factory=list)
    windows: list[StatWindow] = field(default_factory=list)
    runs: list[tuple[float, float]] = field(default_factory=list)  # spans its windows surely cover, in order
    usable: bool = True
    problem: str = ""  # why it is not usable, for the reason
    late: dict[int, float] = field(default_factory=dict)  # line index -> time of a count written seconds later

    def covers(self, lo: float, hi: float) -> bool:
        """True when one run of consecutive windows surely covers [lo, hi]."""
        i = bisect.bisect_right(self.runs, (lo, float("inf"))) - 1
        return i >= 0 and self.runs[i][0] <= lo and hi <= self.runs[i][1]


class Ledger:
    """Every offered read of the logs against P's stats windows (see the module docstring)."""

    def __init__(self, offers: list[Offer], streams: list[_Stream], per_read: int | None, offset: float,
                 problem: str | None, all_prefills: bool, prefix_caching: bool | None) -> None:
        self.offers = {o.rid: o for o in offers}
        self.streams = streams
        self.per_read = per_read
        self.offset = offset  # P's clock minus the proxy's
        self.problem = problem
        self.all_prefills = all_prefills
        self.prefix_caching = prefix_caching
        self.windows = sorted((w for s in streams if s.usable for w in s.windows), key=lambda w: w.hi)
        self.recovered: list[tuple[float, VllmRecord]] = []  # P's clock
        self.plan_note: str | None = None  # why the transfers per read are unknown, when they are
        self.caching_line: VllmRecord | None = None  # the line saying whether P caches prefixes
        open_offers = sorted((o for o in offers if o.counted is not False), key=lambda o: o.lo)
        self._open = open_offers
        self._los = [self._span(o)[0] for o in open_offers]
        self._open_his = [self._span(o)[1] for o in open_offers]  # (each read's end, in self._open's order)
        self._his = sorted(self._open_his)
        self._longest = max((o.hi - o.lo + 2 * CLOCK_SLACK_S for o in open_offers), default=0.0)
        self._tight: dict[str, tuple[StatWindow, ...]] = {}
        self._problems: list[tuple[float, float, str]] = []  # windows whose counts no offered read explains
        self._his_w = [w.hi for w in self.windows]
        self._longest_w = max((w.hi - w.lo for w in self.windows), default=0.0)
        if problem is None:
            self._find_tight_runs()
        self._problems.sort(key=lambda p: p[1])
        self._problem_his = [p[1] for p in self._problems]

    def _span(self, offer: Offer) -> tuple[float, float]:
        """When the read could complete, on P's clock, widened by the clocks' slack."""
        return offer.lo + self.offset - CLOCK_SLACK_S, offer.hi + self.offset + CLOCK_SLACK_S

    def _intersecting(self, lo: float, hi: float) -> list[Offer]:
        start = bisect.bisect_left(self._los, lo - self._longest)
        end = bisect.bisect_left(self._los, hi)
        return [o for o, o_hi in zip(self._open[start:end], self._open_his[start:end], strict=True) if o_hi > lo]

    def _count(self, lo: float, hi: float) -> int:
        return bisect.bisect_left(self._los, hi) - bisect.bisect_right(self._his, lo)

    def _find_tight_runs(self) -> None:
        k = self.per_read
        wins = [w for w in self.windows if w.complete]
        for i in range(len(wins)):
            c, lo, hi = 0, wins[i].lo, wins[i].hi
            for j in range(i, min(i + MAX_BLOCK, len(wins))):
                w = wins[j]
                c, lo, hi = c + w.successes, min(lo, w.lo), max(hi, w.hi)
                n = self._count(lo, hi)
                if k is not None and c > k * n:
                    self._problems.append((lo, hi, (
                        f"P's stats window ending {w.evidence.ts} counts more successful transfers ({c}) than the {n} "
                        "read(s) the proxy log offered in it allow: another router feeds P, part of the proxy log "
                        "is missing, or P's clock differs from the proxy's")))
                    break
                if k is not None and n and c == k * n:
                    run = tuple(wins[i:j + 1])
                    for o in self._intersecting(lo, hi):
                        if o.rid not in self._tight or len(self._tight[o.rid]) > len(run):
                            self._tight[o.rid] = run

    def _windows_in(self, lo: float, hi: float) -> list[StatWindow]:
        """The windows (every P engine) overlapping (lo, hi)."""
        start = bisect.bisect_right(self._his_w, lo)
        end = bisect.bisect_left(self._his_w, hi + self._longest_w)
        return [w for w in self.windows[start:end] if w.lo < hi and w.hi > lo]

    def _candidates(self, offer: Offer) -> list[StatWindow]:
        lo, hi = self._span(offer)
        return self._windows_in(lo, hi)

    def _problem_near(self, offer: Offer) -> str | None:
        """A window near this read whose count no offered read explains: then nothing near it is decided."""
        lo, hi = self._span(offer)
        i = bisect.bisect_left(self._problem_his, lo - PROBLEM_RADIUS_S)
        return next((why for p_lo, _, why in self._problems[i:] if p_lo <= hi + PROBLEM_RADIUS_S), None)

    def _surely_none(self, offer: Offer) -> bool:
        """No P engine can have counted a successful read for this offer.

        Every P engine's windows cover the whole time the read could end, and their successes are
        taken by reads known to have succeeded whose own time lies inside it (DEBUG lines, events).
        """
        if not self.all_prefills or not self.streams:
            return False
        lo, hi = self._span(offer)
        if not all(st.usable and st.covers(lo, hi) for st in self.streams):
            return False
        total = sum(w.successes for w in self._windows_in(lo, hi))
        if not total:
            return True
        if self.per_read is None:
            return False
        inside = sum(1 for o in self._intersecting(lo, hi) if o.counted and lo <= self._span(o)[0]
                     and self._span(o)[1] <= hi)
        return total == self.per_read * inside

    def recovered_near(self, rid: str) -> VllmRecord | None:
        """A ``Recovered from KV load failure`` line of P (no request ids) the offered read may be in."""
        offer = self.offers.get(rid)
        if offer is None:
            return None
        lo, hi = self._span(offer)
        return next((rec for t, rec in self.recovered if lo - 1 <= t <= hi), None)

    def finding(self, rid: str) -> WindowFinding | None:
        """What the windows say about the read offered to request ``rid`` (None: no such offer)."""
        offer = self.offers.get(rid)
        if offer is None:
            return None
        if offer.rejected is not None:
            return WindowFinding(None, (), (), "P rejected the handle as invalid ('Got invalid KVTransferParams'), "
                                 "so it read nothing for a reason no threshold or cache explains",
                                 self.prefix_caching, rejected=offer.rejected)
        problem = self.problem or self._problem_near(offer)
        if problem is not None:
            return WindowFinding(None, tuple(self._candidates(offer)), (), problem, self.prefix_caching)
        run = self._tight.get(rid)
        if run is not None:
            lo, hi = min(w.lo for w in run), max(w.hi for w in run)
            peers = tuple(o for o in self._intersecting(lo, hi) if o.rid != rid)
            total = sum(w.successes for w in run)
            return WindowFinding(True, run, peers, _accounted(run, total, len(peers) + 1, self.per_read or 1),
                                 self.prefix_caching)
        cands = tuple(self._candidates(offer))
        if self._surely_none(offer):
            return WindowFinding(False, cands, (), _none_counted(cands), self.prefix_caching)
        if not cands:
            bad = next((st for st in self.streams if not st.usable), None)
            why = (f"P's stat lines ({bad.name}) {bad.problem}, so they mark no stats windows" if bad
                   else "no stats window of P covers the time of this read (no stat lines, P idle at DEBUG level, "
                   "or P's log does not reach that far)")
            return WindowFinding(None, (), (), why, self.prefix_caching)
        lo, hi = min(w.lo for w in cands), max(w.hi for w in cands)
        peers = tuple(o for o in self._intersecting(lo, hi) if o.rid != rid)
        total = sum(w.successes for w in cands)
        why = _shared(cands, total, peers, self.per_read)
        if self.per_read is None and self.plan_note:
            why += f" ({self.plan_note})"
        return WindowFinding(None, cands, peers, why, self.prefix_caching)


def _span(windows: Iterable[StatWindow]) -> str:
    ends = sorted({w.evidence.ts for w in windows})  # (a count written late widened its window to its time)
    return ends[0] if len(ends) == 1 else f"{ends[0]} to {ends[-1]}"


def _accounted(run: tuple[StatWindow, ...], total: int, reads: int, per_read: int) -> str:
    per = f" ({per_read} NIXL transfers per read)" if per_read > 1 else ""
    noun = "window ending {} counts" if len(run) == 1 else "windows ending {} count"
    return (f"P's stats {noun.format(_span(run))} {total} successful D→P transfer(s){per}, exactly the "
            f"{reads} read(s) the proxy offered P in that time, none declined or failed: this read succeeded")


def _none_counted(cands: tuple[StatWindow, ...]) -> str:
    if not cands:
        return "P counted no successful D→P transfer while this read could run"
    return (f"P's stats window(s) ending {_span(cands)} count no successful D→P transfer, and they cover the "
            "whole time this read could run: P read nothing for it")


def _shared(cands: tuple[StatWindow, ...], total: int, peers: tuple[Offer, ...], per_read: int | None) -> str:
    shown = ", ".join(f"{o.rid} ({o.conv})" if o.conv else o.rid for o in peers[:5])
    more = f" and {len(peers) - 5} more" if len(peers) > 5 else ""
    with_peers = f"; the windows are shared with the read(s) offered to {shown}{more}" if peers else ""
    per = "" if per_read is not None else " (P's log lacks the 'Transfer plan' line that says how many NIXL " \
        "transfers one read makes)"
    return (f"P's stats window(s) ending {_span(cands)} count {total} successful D→P transfer(s){per}, which "
            f"cannot say whether this read was one of them{with_peers}")


def _prefill_paths(index: LogIndex) -> list[str]:
    return [p for p, fmt in index.formats.items() if fmt == "vllm" and index.file_roles.get(p) == "prefill"]


def _p_status(index: LogIndex, p_paths: set[str], offers: dict[str, Offer]) -> list[tuple[Offer, VllmRecord]]:
    """Mark what P's (and D's) per-request lines say of each offer; return P's request lines as clock anchors."""
    by_remote = {o.sent.fields.get("remote"): o for o in offers.values()}
    anchors: list[tuple[Offer, VllmRecord]] = []
    for rec in index.vllm:
        if rec.kind is None:
            continue
        if rec.path not in p_paths:
            if rec.kind == "invalid_unrecognized":  # D: P read blocks D had released (a counted transfer)
                offer = by_remote.get(rec.fields.get("request_id"))
                if offer is not None and offer.counted is None:
                    offer.counted = True
            continue
        if rec.kind == "invalid_params":
            offer = by_remote.get(rec.fields.get("remote_request_id"))
            if offer is not None:
                offer.counted, offer.rejected = False, rec
            continue
        for rid in record_rids(rec):
            offer = offers.get(header_request_id(rid))
            if offer is None:
                continue
            if rec.kind in _NO_READ_KINDS:
                offer.counted = False
            elif rec.kind in _READ_KINDS and offer.counted is None:
                offer.counted = True
            if rec.kind in ("received_request", "added_request", "declining_expired", "nixl_failure",
                            "kv_load_failed", "generated_response"):
                anchors.append((offer, rec))
    for ev in index.events:
        e = ev.event
        if e.source == "prefill" and e.event == "prefill_request" and e.request_id in offers:
            if e.outcome == Verdict.REMOTE_HIT.value:
                offers[e.request_id].counted = True
            elif e.outcome in _EVENT_NO_READ:
                offers[e.request_id].counted = False
    return anchors


# The proxy's kinds the ledger reads (_offers); every other kind only adds to the first time (``ref``).
OFFER_KINDS: Final = frozenset({"ready", "sending", "prefill_done", "prefill_failed", "decode_failed", "cached"})


def _offers(index: LogIndex) -> tuple[dict[str, Offer], int | None]:
    """Every read the proxy offered P; and the prefill instances its last ``Ready`` line names."""
    sent: dict[str, ProxyRecord] = {}
    ends: dict[str, float] = {}
    prefills: int | None = None
    for rec in index.proxy:
        rid = rec.fields.get("rid")
        if rec.kind == "ready":
            prefills = int(rec.fields["p"])
        elif rec.kind == "sending" and rid is not None:
            sent[rid] = rec
        elif rec.kind in ("prefill_done", "prefill_failed", "decode_failed") and rid is not None and rid not in ends:
            t = wall_clock(rec.ts)
            if t is not None:
                ends[rid] = t + 1.0
        elif rec.kind == "cached":
            rid = header_request_id(rec.fields.get("remote", ""))
            t = wall_clock(rec.ts)
            if t is not None and rid not in ends:
                ends[rid] = t + 1.0
    offers: dict[str, Offer] = {}
    for rid, rec in sent.items():
        lo = wall_clock(rec.ts)
        if lo is None:
            continue
        hi = max(lo + 1.0, ends.get(rid, lo + OPEN_READ_S))
        offers[rid] = Offer(rid=rid, conv=rec.fields.get("conv"), lo=lo, hi=hi, sent=rec)
    return offers, prefills


def _per_read(plans: list[VllmRecord]) -> tuple[int | None, str | None]:
    """NIXL transfers per D→P read from P's ``Transfer plan`` lines (one per local rank and D engine)."""
    values: set[int] = set()
    for rec in plans:
        f = rec.fields
        if f.get("remote_pp", 0) > 0 or f.get("local_dcp", 1) > 1 or f.get("remote_dcp", 1) > 1:
            return None, "P reads from D with pipeline or decode-context parallelism, whose transfer count per " \
                         "read kvdiag does not model"
        ratio = f.get("tp_ratio", 1)
        values.add(f.get("local_tp", 1) * (-ratio if ratio < 0 else 1))
    if len(values) > 1:
        return None, "P reads from D engines whose layouts make different transfer counts per read"
    return (values.pop() if values else None), None


def _build_streams(index: LogIndex, p_paths: list[str], ref: float) -> tuple[list[_Stream], list[VllmRecord],
                                                                            list[VllmRecord]]:
    streams: dict[tuple[str, int], _Stream] = {}
    plans: list[VllmRecord] = []
    configs: list[VllmRecord] = []
    last: dict[str, tuple[_Stream, int] | None] = {}  # path -> the stream and index of its latest Engine line
    # path -> a KV line whose Engine line has not come yet, and the earlier Engine line (without a count) it
    # follows in the file
    pending: dict[str, tuple[VllmRecord, tuple[_Stream, int] | None]] = {}
    orphans: set[str] = set()  # files with a KV line no Engine line of the same tick takes
    p_set = set(p_paths)
    for rec in index.vllm:
        if rec.path not in p_set:
            continue
        if rec.kind == "engine_stats":
            key = (rotation_base(rec.path), int(rec.fields["engine"]))
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = _Stream(name=f"{key[0]} engine {key[1]:03d}", group=key[0])
            t = vllm_wall_clock(rec.ts, ref)
            if t is None:
                continue
            kv = None
            if rec.path in pending:
                kv, before = pending.pop(rec.path)
                if kv.ts != rec.ts:
                    _late_count(kv, before, rec.path, orphans, ref)
                    kv = None
            stream.lines.append((t, rec, kv))
            last[rec.path] = (stream, len(stream.lines) - 1) if kv is None else None
        elif rec.kind == "kv_metrics":
            # vLLM logs it right after its tick's Engine line, in the same call: the same second, unless
            # the process stalled between the two writes; a merge sorted by time may put it first
            slot = last.get(rec.path)
            if slot is not None and slot[0].lines[slot[1]][1].ts == rec.ts:
                _attach(slot, rec)
                last[rec.path] = None
            else:
                if rec.path in pending:
                    orphans.add(rec.path)
                pending[rec.path] = (rec, slot)
                last[rec.path] = None
        elif rec.kind == "transfer_plan":
            plans.append(rec)
        elif rec.kind == "engine_config":
            configs.append(rec)
    for path, (kv, before) in pending.items():
        _late_count(kv, before, path, orphans, ref)
    for stream in streams.values():
        _windows(stream)
        if any(p.startswith(stream.group) for p in orphans):
            stream.usable = False  # a count that belongs to no window: the file's windows are not complete
            stream.problem = "hold a KV Transfer metrics line that follows no Engine line of its tick"
    return list(streams.values()), plans, configs


def _attach(slot: tuple[_Stream, int], kv: VllmRecord) -> None:
    st, i = slot
    t, eng, _ = st.lines[i]
    st.lines[i] = (t, eng, kv)


def _late_count(kv: VllmRecord, before: tuple[_Stream, int] | None, path: str, orphans: set[str], ref: float
                ) -> None:
    """A KV line no Engine line of its own second takes.

    The Engine line it follows wrote it late (the process stalled between the two writes; vLLM's stat
    loop sleeps a whole interval after the call returns, so the next tick is later still), or that
    tick's own Engine line is missing or comes later. Either way its count falls between the start of
    the earlier line's window (which counted nothing itself) and its own second: that window is widened
    to end there. Without such a line before it, it belongs to no window.
    """
    t = vllm_wall_clock(kv.ts, ref)
    if before is None or t is None:
        orphans.add(path)
        return
    _attach(before, kv)
    before[0].late[before[1]] = t


def _successes(kv: VllmRecord | None) -> int | None:
    if kv is None:
        return 0
    try:
        return int(str(kv.fields.get("Num successful transfers", "")).strip())
    except ValueError:
        return None


def _windows(stream: _Stream) -> None:
    """Turn a stream's tick lines into windows, if they are periodic; else mark it unusable."""
    lines = stream.lines
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(lines)]
    positive = [g for g in gaps if g > 0]
    if len(positive) < 1 or len(gaps) - len(positive) > 0.05 * len(gaps) or min(gaps, default=0) < 0:
        stream.usable = False  # fewer than two ticks, several per second, or time going backwards
        stream.problem = "are not periodic (several a second, or fewer than two)"
        return
    floor = min(positive)
    interval = statistics.median([g for g in positive if g <= 1.5 * floor + 1])
    run_start: float | None = None
    prev: float | None = None
    for i, (t, eng, kv) in enumerate(lines):
        n = _successes(kv)
        if n is None:
            stream.usable = False
            stream.problem = "hold a KV Transfer metrics line whose count of successful transfers is not a number"
            return
        consecutive = prev is not None and t - prev <= interval + 1.5
        lo = prev if consecutive and prev is not None else t - interval - 1
        if not consecutive:
            if run_start is not None and prev is not None:
                stream.runs.append((run_start, prev))
            run_start = t + 1 - interval
        hi = max(t, stream.late.get(i, t)) + 1
        stream.windows.append(StatWindow(stream=stream.name, lo=lo, hi=hi, successes=n, line=eng, kv_line=kv))
        prev = t
    if run_start is not None and prev is not None:
        stream.runs.append((run_start, prev))


def _prefix_caching(streams: list[_Stream], configs: list[VllmRecord]) -> tuple[bool | None, VllmRecord | None]:
    """Whether P runs with prefix caching, and the line that says so.

    Its startup config states it; and vLLM's Engine line carries ``Prefix cache hit rate`` once a
    request looked the cache up, which never happens with prefix caching off.
    """
    said: dict[bool, VllmRecord] = {}
    for c in configs:
        if "prefix_caching" in c.fields:
            said.setdefault(bool(c.fields["prefix_caching"]), c)
    for st in streams:
        for _t, eng, _kv in st.lines:
            if eng.fields.get("prefix_hit_rate") is not None:
                said.setdefault(True, eng)
            elif eng.fields.get("prompt_throughput"):
                said.setdefault(False, eng)
    if len(said) != 1:
        return None, None
    value, line = next(iter(said.items()))
    return value, line


def _clock_offset(anchors: list[tuple[Offer, VllmRecord]], ref: float) -> tuple[float, str | None]:
    """P's clock minus the proxy's, from P's lines that name an offered request (0 when none does)."""
    samples: list[tuple[float, float, float]] = []  # (P time, offer lo, offer hi)
    for offer, rec in anchors:
        t = vllm_wall_clock(rec.ts, ref)
        if t is not None:
            samples.append((t, offer.lo, offer.hi))

    def fits(off: float) -> bool:
        return all(lo - 1 - CLOCK_SLACK_S <= t - off <= hi + CLOCK_SLACK_S for t, lo, hi in samples)

    if fits(0.0):
        return 0.0, None
    off = statistics.median(t - lo for t, lo, _ in samples)
    if fits(off):
        return off, None
    return 0.0, "P's clock and the proxy's disagree (P's lines naming requests fall outside the proxy's times for them)"


def clock_offset(index: LogIndex) -> float:
    """P's clock minus the proxy's, as build_ledger measures it, on the P lines of ``index`` that name a request
    the proxy offered (0 when none does, or when they disagree)."""
    p_paths = _prefill_paths(index)
    offers, _prefills = _offers(index)
    if not p_paths or not offers:
        return 0.0
    return _clock_offset(_p_status(index, set(p_paths), offers), _first_time(index))[0]


def _first_time(index: LogIndex) -> float:
    """The earliest proxy record's time (an offer's record has one)."""
    return min(t for t in (wall_clock(r.ts) for r in index.proxy) if t is not None)


@dataclass(frozen=True)
class ProxyRange:
    """The time the proxy log files given cover (their first and last lines), proxy clock."""

    first: float
    last: float
    fresh: bool  # the earliest file opens with the proxy's "Ready" line: no request came before


def build_ledger(index: LogIndex, log_range: ProxyRange, *, spans: list[tuple[float, float]] | None = None,
                 ref: float | None = None) -> Ledger | None:
    """The ledger of every offered read against P's stats windows, or None without offers or a P log.

    ``spans``: the proxy-clock spans whose every proxy line is in the index (default: all of
    ``log_range``). Only windows inside one of them can account for all of their reads. ``ref``: the time of
    the earliest proxy record, when the index holds only those of OFFER_KINDS (default: the index's earliest).
    """
    p_paths = _prefill_paths(index)
    offers, prefills = _offers(index)
    if not p_paths or not offers:
        return None
    if ref is None:
        ref = _first_time(index)
    streams, plans, configs = _build_streams(index, p_paths, ref)
    anchors = _p_status(index, set(p_paths), offers)
    offset, problem = _clock_offset(anchors, ref)
    per_read, plan_note = _per_read(plans)
    # A read sent shortly before a covered span may land in its first windows, unless the proxy had just
    # started there (its "Ready" line opens the log); the log's last line ends what it can tell.
    bounds = []
    for lo, hi in spans or [(log_range.first, log_range.last)]:
        lo, hi = max(lo, log_range.first), min(hi, log_range.last + 1)
        lead = 0.0 if log_range.fresh and lo <= log_range.first else LEAD_S
        bounds.append((lo + offset + lead, hi + offset))
    for stream in streams:
        for w in stream.windows:
            w.complete = any(lo <= w.lo and w.hi <= hi for lo, hi in bounds)
    groups = {rotation_base(p) for p in p_paths}
    all_prefills = prefills is not None and prefills == len(groups)
    caching, caching_line = _prefix_caching(streams, configs)
    ledger = Ledger(list(offers.values()), streams, per_read, offset, problem, all_prefills, caching)
    ledger.plan_note = plan_note
    ledger.caching_line = caching_line
    for rec in index.vllm:
        if rec.kind == "kv_load_recovered" and rec.path in p_paths:
            t = vllm_wall_clock(rec.ts, ref)
            if t is not None:
                ledger.recovered.append((t, rec))
    return ledger
