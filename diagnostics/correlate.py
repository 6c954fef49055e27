"""Join client, router/proxy, prefill and decode records into per-turn facts, by ids not clocks.

conversation_id → router X-Request-Id (proxy ``[rid]``, events ``request_id``) → engine external id
``chatcmpl-<rid>`` → internal ``chatcmpl-<rid>-<8>`` → D's internal id is the ``remote_request_id``
handed to P next turn. Hashed conversation ids (router ``--hash-ids``: sha256 hex prefix) join too.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Final

from kvdiag.diagnostics.json_logs import ClientStat, EventRecord
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log import ProxyRecord, wall_clock
from kvdiag.diagnostics.vllm_log import VllmRecord, header_request_id

HASH_PREFIX_LENGTHS: Final = (12, 16, 64)
# vLLM kinds only a prefill (reader) engine logs: they tell a file's role when its name does not.
# (D also reads, from P, so read/recv lines say nothing about the role.)
PREFILL_KINDS: Final = frozenset({"declining_expired", "skip_remote_pull"})


def id_tags(conversation_id: str) -> list[str]:
    """The id itself and the hashed forms a router may log instead of it."""
    digest = hashlib.sha256(conversation_id.encode("utf-8", errors="replace")).hexdigest()
    return [conversation_id, *(digest[:n] for n in HASH_PREFIX_LENGTHS)]


@dataclass
class LogIndex:
    """Everything parsed from the inputs, in file order."""

    events: list[EventRecord] = field(default_factory=list)
    client: list[ClientStat] = field(default_factory=list)
    proxy: list[ProxyRecord] = field(default_factory=list)
    vllm: list[VllmRecord] = field(default_factory=list)
    file_roles: dict[str, str | None] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)  # path -> format
    stats: LineStats = field(default_factory=LineStats)

    def has(self, fmt: str) -> bool:
        """True when at least one input file has this format."""
        return fmt in self.formats.values()

    def has_role(self, role: str) -> bool:
        """True when a vLLM log or an event file of this role (prefill/decode) was given."""
        if any(r == role for p, r in self.file_roles.items() if self.formats.get(p) == "vllm"):
            return True
        return any(e.event.source == role for e in self.events)


@dataclass
class ProxyRequest:
    """One request as the proxy log shows it."""

    rid: str
    conv: str | None
    seq: int
    lines: list[ProxyRecord] = field(default_factory=list)
    lookup: str | None = None  # hit, miss, stale, no_handle, no_conversation_id
    offered_remote_id: str | None = None
    stored: ProxyRecord | None = None  # "cached D blocks" after this request
    stored_seq: int | None = None
    not_stored: ProxyRecord | None = None  # "not caching D blocks because ..." after this request
    withheld: ProxyRecord | None = None  # "cache MISS (request history changed)": a handle held back

    @property
    def start_ts(self) -> float | None:
        """The proxy's wall clock when the request arrived (its first line)."""
        return wall_clock(self.lines[0].ts) if self.lines else None


@dataclass
class TurnFacts:
    """Everything known about one turn, before classification."""

    conversation_id: str
    turn: int
    request_id: str | None = None
    client_events: list[EventRecord] = field(default_factory=list)
    router_events: list[EventRecord] = field(default_factory=list)
    prefill_events: list[EventRecord] = field(default_factory=list)
    decode_events: list[EventRecord] = field(default_factory=list)
    client_stat: ClientStat | None = None
    proxy: ProxyRequest | None = None
    p_records: list[VllmRecord] = field(default_factory=list)
    d_records: list[VllmRecord] = field(default_factory=list)
    other_records: list[VllmRecord] = field(default_factory=list)  # engine lines of a file of unknown role
    released_handle: list[VllmRecord] = field(default_factory=list)  # D released the handle this turn got
    stale_read: list[VllmRecord] = field(default_factory=list)  # D: blocks of that handle read after release
    restart_before: ProxyRecord | None = None  # proxy "Ready" between the previous turn and this one
    concurrent: bool = False


@dataclass
class Conversation:
    """A conversation's turns as joined facts."""

    conversation_id: str
    turns: list[TurnFacts] = field(default_factory=list)


def infer_file_roles(index: LogIndex) -> None:
    """Fill unknown vLLM file roles from content (prefill-only messages), else leave None."""
    by_file: dict[str, set[str]] = defaultdict(set)
    for rec in index.vllm:
        if rec.kind:
            by_file[rec.path].add(rec.kind)
    for path, kinds in by_file.items():
        if index.file_roles.get(path) is None and kinds & PREFILL_KINDS:
            index.file_roles[path] = "prefill"


def _proxy_requests(index: LogIndex, tag_to_conv: dict[str, str]
                    ) -> tuple[dict[str, ProxyRequest], list[tuple[int, ProxyRecord]], list[str]]:
    """Group proxy lines by request id; return (requests, restart lines, rids sent without a conversation)."""
    requests: dict[str, ProxyRequest] = {}
    pending: dict[str, ProxyRecord] = {}  # conv -> hit/stale line waiting for its "[rid] conv=" line
    restarts: list[tuple[int, ProxyRecord]] = []
    no_conv: list[str] = []
    last: dict[str, ProxyRequest] = {}  # conv -> its latest request
    for seq, rec in enumerate(index.proxy):
        conv = rec.fields.get("conv")
        conv = tag_to_conv.get(conv, conv) if conv is not None else None
        rid = rec.fields.get("rid")
        if rec.kind == "ready":
            restarts.append((seq, rec))
            continue
        if rec.kind in ("hit", "stale", "miss_head") and conv is not None:
            pending[conv] = rec
            continue
        if rec.kind == "not_cached":
            target = requests.get(rid) if rid is not None else last.get(conv) if conv is not None else None
            if target is not None:
                target.not_stored = rec
                target.lines.append(rec)
            continue
        if rec.kind == "cached":
            rid = header_request_id(rec.fields["remote"])
            req = requests.get(rid)
            if req is not None:
                req.stored, req.stored_seq = rec, seq
                req.lines.append(rec)
            continue
        if rid is None:
            continue
        req = requests.get(rid)
        if req is None:
            req = requests[rid] = ProxyRequest(rid=rid, conv=conv, seq=seq)
        req.lines.append(rec)
        if rec.kind == "no_conversation_id":
            req.lookup = "no_conversation_id"
            no_conv.append(rid)
        elif rec.kind in ("sending", "miss", "no_handle"):
            req.conv = conv
            head = pending.pop(conv, None) if conv is not None else None
            if head is not None:
                req.lines.insert(0, head)
            if conv is not None:
                last[conv] = req
            if rec.kind == "sending":
                req.lookup, req.offered_remote_id = "hit", rec.fields.get("remote")
            else:
                req.lookup = "stale" if head is not None and head.kind == "stale" else rec.kind
                why = [ln for ln in (head, rec) if ln is not None and ln.kind in ("miss", "miss_head")
                       and ln.fields.get("why")]
                if why:
                    req.withheld = why[0]
    return requests, restarts, no_conv


def _stat_turns(stats: list[ClientStat]) -> list[tuple[int, ClientStat]]:
    """Turn numbers for benchmark records: explicit ``turn``, else order by messages sent then start."""
    if all(s.turn is not None for s in stats):
        return [(s.turn or 0, s) for s in stats]
    ordered = sorted(stats, key=lambda s: (s.input_num_turns or 0, s.start_time_ms or 0.0, s.lineno))
    return [(i, s) for i, s in enumerate(ordered, start=1)]


def user_turn(stat: ClientStat) -> int | None:
    """The turn a benchmark record measured, from the messages it sent (user, assistant, ..., user)."""
    n = stat.input_num_turns
    return (n + 1) // 2 if n is not None and n >= 1 else None


def _first_measured_turn(numbered: list[tuple[int, ClientStat]]) -> int:
    if not numbered or numbered[0][1].turn is not None:
        return 1
    first = user_turn(numbered[0][1])
    return first if first is not None else 1


def correlate(index: LogIndex, only: str | None = None) -> list[Conversation]:
    """Build every conversation's turn facts (or only the one named ``only``)."""
    infer_file_roles(index)
    known: set[str] = set()
    for ev in index.events:
        if ev.event.conversation_id:
            known.add(ev.event.conversation_id)
    known.update(s.conversation_id for s in index.client)
    if only is not None:
        known.add(only)
    tag_to_conv = {tag: conv for conv in known for tag in id_tags(conv)[1:]}

    requests, restarts, _ = _proxy_requests(index, tag_to_conv)
    convs: dict[str, dict[tuple[int, str], TurnFacts]] = defaultdict(dict)
    by_rid: dict[str, TurnFacts] = {}

    def slot(conv: str, turn: int, rid: str | None) -> TurnFacts:
        if rid is not None and rid in by_rid:
            return by_rid[rid]
        turns = convs[conv]
        key = (turn, rid or "")
        facts = turns.get(key)
        if facts is None and rid is not None:
            # a rid-less slot of the same turn (client stats) is the same request
            facts = turns.pop((turn, ""), None)
            if facts is not None:
                turns[key] = facts
        if facts is None:
            facts = turns[key] = TurnFacts(conversation_id=conv, turn=turn)
        if rid is not None:
            facts.request_id = rid
            by_rid[rid] = facts
        return facts

    # 1. Events with explicit conversation + turn (router first: it owns the request id).
    # One partition of the events (file order kept in each part) instead of three filtered passes.
    router_evs = [ev for ev in index.events if ev.event.source == "router"]
    router_rids = {ev.event.request_id for ev in router_evs}
    client_evs = [ev for ev in index.events if ev.event.source == "client"]
    passes: tuple[tuple[str, list[EventRecord]], ...] = (
        ("router", router_evs),
        ("client", [ev for ev in client_evs if ev.event.request_id in router_rids]),
        ("client-unmatched", [ev for ev in client_evs if ev.event.request_id not in router_rids]),
    )
    for source, part in passes:
        for ev in part:
            e = ev.event
            if e.conversation_id is None or e.turn is None:
                continue
            conv = tag_to_conv.get(e.conversation_id, e.conversation_id)
            if only is not None and conv != only:
                continue
            if source == "client-unmatched":
                # a failed request's client record may carry another id than the router's (no echo
                # header on an error): the one router-only request of that turn is the same request
                lone = [f for (t, _), f in convs[conv].items() if t == e.turn and f.router_events
                        and not f.client_events]
                if len(lone) == 1:
                    lone[0].client_events.append(ev)
                    continue
            facts = slot(conv, e.turn, e.request_id)
            (facts.router_events if source == "router" else facts.client_events).append(ev)
    # Router events without a conversation or turn (no id sent) join through the client's request id.
    for ev in index.events:
        e = ev.event
        if e.source == "router" and (e.conversation_id is None or e.turn is None) and e.request_id in by_rid:
            by_rid[e.request_id].router_events.append(ev)
    # 2. Proxy requests, in order per conversation.
    proxy_by_conv: dict[str, list[ProxyRequest]] = defaultdict(list)
    for req in sorted(requests.values(), key=lambda r: r.seq):
        if req.conv is not None and (only is None or req.conv == only):
            proxy_by_conv[req.conv].append(req)
    for conv, reqs in proxy_by_conv.items():
        for order, req in enumerate(reqs, start=1):
            if req.rid in by_rid:
                by_rid[req.rid].proxy = req
                continue
            taken = {t for (t, r) in convs[conv] if r}
            turn = order if order not in taken else max(taken) + 1
            slot(conv, turn, req.rid).proxy = req
    # 3. Client stats (benchmark records have no request id: join by turn number).
    stats_by_conv: dict[str, list[ClientStat]] = defaultdict(list)
    for stat in index.client:
        if only is None or stat.conversation_id == only:
            stats_by_conv[stat.conversation_id].append(stat)
    for conv, stats in stats_by_conv.items():
        # Requests the router/proxy already placed, in order; the k-th record (by messages sent, then
        # start) is the k-th request. A duplicate sent twice is two requests with one turn number.
        placed = sorted((f for f in convs[conv].values() if f.client_stat is None), key=_request_order)
        numbered = _stat_turns(stats)
        # The benchmark records only answered requests, from its first measured turn on: with
        # --warmup-step turn 1 went through the proxy unmeasured. The first record's message count
        # says which request it is.
        skip = _first_measured_turn(numbered) - 1 if len(placed) > len(numbered) else 0
        for i, (turn, stat) in enumerate(numbered):
            if stat.request_id and stat.request_id in by_rid:
                by_rid[stat.request_id].client_stat = stat
            elif stat.turn is None and i + skip < len(placed):
                placed[i + skip].client_stat = stat
            else:
                same = next((f for (t, _), f in sorted(convs[conv].items()) if t == turn and f.client_stat is None),
                            None)
                (same or slot(conv, turn, stat.request_id)).client_stat = stat
    # 4. Engine events and lines, by request id.
    for ev in index.events:
        e = ev.event
        if e.source not in ("prefill", "decode"):
            continue
        owner: TurnFacts | None = None
        for rid in (e.request_id, e.engine_request_id):
            if rid:
                owner = by_rid.get(rid) or by_rid.get(header_request_id(rid))
                if owner:
                    break
        if owner is None and e.conversation_id and e.turn and (only is None or e.conversation_id == only):
            owner = slot(tag_to_conv.get(e.conversation_id, e.conversation_id), e.turn, None)
        if owner is not None:
            (owner.prefill_events if e.source == "prefill" else owner.decode_events).append(ev)
    handles: dict[str, TurnFacts] = {}  # D internal id offered to a turn -> that turn
    for tf in by_rid.values():
        offered = tf.proxy.offered_remote_id if tf.proxy else None
        for ev in tf.router_events:
            offered = offered or ev.event.remote_request_id
        if offered:
            handles[offered] = tf
    for rec in index.vllm:
        role = index.file_roles.get(rec.path)
        if rec.kind in ("releasing_expired", "invalid_unrecognized") and role != "prefill":
            target = handles.get(rec.fields["request_id"])
            if target is not None:
                (target.released_handle if rec.kind == "releasing_expired" else target.stale_read).append(rec)
                continue
        attached: list[TurnFacts] = []  # a batch line ("Failing 2 request(s) … Request IDs: {…}") names several
        for rid in record_rids(rec):
            joined = by_rid.get(header_request_id(rid))
            if joined is None or any(joined is a for a in attached):
                continue
            attached.append(joined)
            if role == "prefill" or (role is None and _reads_from_decode(rec, joined)):
                joined.p_records.append(rec)
            elif role == "decode":
                joined.d_records.append(rec)
            else:
                joined.other_records.append(rec)
    # 5. Order, restarts and concurrency.
    out: list[Conversation] = []
    for conv, turns in convs.items():
        ordered = sorted(turns.values(), key=lambda f: (f.turn, f.proxy.seq if f.proxy else 0))
        for prev, cur in itertools.pairwise(ordered):
            if prev.proxy and cur.proxy:
                lo = prev.proxy.stored_seq if prev.proxy.stored_seq is not None else prev.proxy.seq
                cur.restart_before = next(
                    (r for seq, r in restarts if r.path == cur.proxy.lines[-1].path and lo < seq < cur.proxy.seq),
                    None)
                cur.concurrent = prev.proxy.stored_seq is not None and prev.proxy.stored_seq > cur.proxy.seq
        out.append(Conversation(conversation_id=conv, turns=ordered))
    return out


def _request_order(f: TurnFacts) -> tuple[int, float]:
    if f.proxy is not None:
        return (f.turn, float(f.proxy.seq))
    ts = [e.event.ts for e in (*f.router_events, *f.client_events)]
    return (f.turn, min(ts) if ts else 0.0)


def record_rids(rec: VllmRecord) -> list[str]:
    """The request ids a vLLM record names (its own, a failed batch's, a NIXL context's)."""
    f = rec.fields
    rids = [f["request_id"]] if isinstance(f.get("request_id"), str) else []
    rids += [r for r in f.get("request_ids", []) if isinstance(r, str)]
    ctx = f.get("context")
    if isinstance(ctx, dict) and isinstance(ctx.get("request_id"), str):
        rids.append(ctx["request_id"])
    return rids


def _reads_from_decode(rec: VllmRecord, facts: TurnFacts) -> bool:
    """For a line of unknown role: is it P's side of a D→P read (not D's side of P→D)?"""
    if rec.kind in PREFILL_KINDS:
        return True
    ctx = rec.fields.get("context")
    if rec.kind == "nixl_failure" and isinstance(ctx, dict) and isinstance(ctx.get("remote_request_id"), str):
        # P's D→P read names D's id from the previous turn; D's P→D read names P's id of this turn.
        return header_request_id(ctx["remote_request_id"]) != facts.request_id
    return False
