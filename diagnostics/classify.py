"""The verdict classifier: one TurnRecord per joined turn, following docs/design.md Contract 4.

Instrumented logs state the outcome (router_turn merged with P's report): those verdicts are
``confirmed``. Stock logs are read rule by rule (docs/verdicts.md says which line proves which
verdict); a verdict deduced from absent lines is ``inferred``, and where stock logs cannot tell
the answer is ``unknown`` naming the source that would. A wrong ``confirmed`` verdict is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvdiag.diagnostics.correlate import LogIndex, ProxyRequest, TurnFacts
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord
from kvdiag.diagnostics.proxy_log import ProxyRecord
from kvdiag.diagnostics.records import Evidence, TurnRecord
from kvdiag.diagnostics.vllm_log import VllmRecord
from kvdiag.diagnostics.windows import Ledger
from kvdiag.schema.events import TurnEvent
from kvdiag.schema.verdicts import VERDICT_INFO, Confidence, Verdict

CONFIRMED = Confidence.CONFIRMED
INFERRED = Confidence.INFERRED
DEFAULT_BLOCK_SIZE = 16
DEFAULT_DECODE_TTL_S = 480
TOKEN_MARGIN = 16  # the benchmark counts message content only; a re-tokenized reply may differ a little
FAILED_STATUSES = ("error", "aborted", "disconnected", "timeout", "hung")
# TurnRecord fields the client states first (its events, then its statistics), as (record, event) names.
_CLIENT_FIRST = (("ttft_ms", "ttft_ms"), ("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens"),
                 ("latency_ms", "duration_ms"))
# TurnRecord fields taken from the first event that states them (client, then router, then P).
_EVENT_NUMBERS = ("ttft_ms", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                  "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s", "model",
                  "failure_type", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason",
                  "wrong_kv_tokens", "mismatch_tokens")


@dataclass
class Context:
    """Run-wide facts the rules need: which sources exist and the engines' settings seen in logs."""

    has_client: bool
    has_router: bool
    has_prefill: bool
    has_decode: bool
    p_bidir: bool | None = None  # P logged "Bidirectional KV transfer is enabled" (None: no P log)
    p_debug: bool = False  # P's log has DEBUG lines: every D->P decision is then logged
    d_bidir: bool | None = None
    decode_ttl_s: float | None = None
    router_ttl_s: float | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    threshold: int | None = None  # P's kv_recompute_threshold (its startup line)
    windows: Ledger | None = None  # P's stats windows against the offered reads (INFO-level evidence)
    window_wanted: set[str] = field(default_factory=set)  # requests a window would decide

    @classmethod
    def from_index(cls, index: LogIndex) -> Context:
        """Collect the run-wide facts from everything parsed."""
        ctx = cls(has_client=index.has("client_stats") or any(e.event.source == "client" for e in index.events),
                  has_router=index.has("proxy") or any(e.event.source == "router" for e in index.events),
                  has_prefill=index.has_role("prefill"), has_decode=index.has_role("decode"))
        roles = {p: r for p, r in index.file_roles.items() if index.formats.get(p) == "vllm"}
        if "prefill" in roles.values():
            ctx.p_bidir = False
        if "decode" in roles.values():
            ctx.d_bidir = False
        for rec in index.vllm:
            role = index.file_roles.get(rec.path)
            if rec.level == "DEBUG" and role == "prefill":
                ctx.p_debug = True
            if rec.kind == "bidir_enabled":
                if role == "prefill":
                    ctx.p_bidir = True
                    ctx.threshold = int(rec.fields["threshold"])
                elif role == "decode":
                    ctx.d_bidir = True
                    if rec.fields.get("ttl_s") is not None:
                        ctx.decode_ttl_s = float(rec.fields["ttl_s"])
            elif rec.kind == "read_blocks":
                ctx.block_size = int(rec.fields["block_size"])
        for ev in index.events:
            e = ev.event
            if e.event == "kv_retained" and e.ttl_s is not None:
                ctx.decode_ttl_s = e.ttl_s
            elif e.event == "engine_start":
                # instrumented engines state their settings at startup
                bidir = e.attrs.get("bidirectional_kv_xfer")
                if isinstance(bidir, bool):
                    setattr(ctx, "p_bidir" if e.source == "prefill" else "d_bidir", bidir)
                if isinstance(e.attrs.get("block_size"), int):
                    ctx.block_size = e.attrs["block_size"]
                ttl = e.attrs.get("decoder_kv_blocks_ttl")
                if e.source == "decode" and isinstance(ttl, int | float) and not isinstance(ttl, bool):
                    ctx.decode_ttl_s = float(ttl)
        for prec in index.proxy:
            if prec.kind == "stale":
                ctx.router_ttl_s = float(prec.fields["ttl"])
        return ctx


class Located(Protocol):
    """Any parsed record: where it is (``file:line``) and its text."""

    @property
    def source(self) -> str: ...

    @property
    def text(self) -> str: ...


def _ev(rec: Located) -> Evidence:
    return Evidence(source=rec.source, text=rec.text[:300])


class _Turn:
    """Builder for one TurnRecord: numbers from every source, then one verdict."""

    def __init__(self, facts: TurnFacts) -> None:
        self.f = facts
        self.rec = TurnRecord(conversation_id=facts.conversation_id, turn=facts.turn, request_id=facts.request_id)
        self._numbers()

    def _numbers(self) -> None:
        r, f = self.rec, self.f
        events: list[TurnEvent] = [e.event for e in (*f.client_events, *f.router_events, *f.prefill_events)]
        # Plain dataclasses: their __dict__ is the fields (a direct read beats getattr/setattr per field).
        mine, theirs = r.__dict__, [e.__dict__ for e in events]
        if events:
            r.start_ts = events[0].ts
        for name in _EVENT_NUMBERS:  # the first event stating a field wins
            for state in theirs:
                if state[name] is not None:
                    mine[name] = state[name]
                    break
        for e in events:
            if r.remote_tokens is None and e.remote_read_tokens is not None:
                r.remote_tokens = e.remote_read_tokens
            if e.duration_ms is not None and r.latency_ms is None:
                r.latency_ms = e.duration_ms
            if e.status is not None and (r.status is None or e.status != "ok"):
                r.status = e.status
        for cev in f.client_events:
            if cev.event.status is not None:
                r.status = cev.event.status  # the client's status: a retried P attempt is no failed turn
        # What the user saw comes from the client first, whatever else is present (docs/verdicts.md):
        # its events, then its statistics, then the router and P. So the id setting, which decides
        # whether router events join, never switches the source of a turn's TTFT or prompt bucket.
        s = f.client_stat
        if s is not None:
            for name, value in (("ttft_ms", s.ttft_ms), ("prompt_tokens", s.input_num_tokens),
                                ("completion_tokens", s.output_num_tokens), ("latency_ms", s.latency_ms)):
                if value is not None:
                    mine[name] = value
        for cev in reversed(f.client_events):  # the first client event stating a field wins
            state = cev.event.__dict__
            for name, event_name in _CLIENT_FIRST:
                if state[event_name] is not None:
                    mine[name] = state[event_name]
        # vLLM's benchmark takes start_time_ms from time.perf_counter_ns() (time since boot): only an epoch
        # value is a date. Else the proxy's arrival line dates the turn; the benchmark's own clock still
        # orders the turns and measures the gaps between them.
        if r.start_ts is None and s is not None:
            r.start_ts = s.start_ts
        if r.start_ts is None and f.proxy is not None:
            r.start_ts = f.proxy.start_ts
        if r.start_ts is not None and r.latency_ms is not None:
            r.end_ts = r.start_ts + r.latency_ms / 1000.0
        if f.proxy is not None:
            for line in f.proxy.lines:
                if line.kind == "prefill_done" and r.prefill_ms is None:
                    r.prefill_ms = float(line.fields["ms"])
                elif line.kind in ("hit", "stale") and r.entry_age_s is None:
                    r.entry_age_s = float(line.fields["age"])
        for pev in f.prefill_events:
            if pev.event.engine_request_id:
                r.prefill_request_id = pev.event.engine_request_id
        for dev in f.decode_events:
            if dev.event.engine_request_id:
                r.decode_request_id = dev.event.engine_request_id

    def set(self, verdict: Verdict, confidence: Confidence, reason: str, *evidence: Located | None) -> TurnRecord:
        r = self.rec
        r.verdict, r.confidence, r.reason = verdict, confidence, reason
        r.fix = VERDICT_INFO[verdict].fix
        # the deciding lines first, then whatever _with_failure added
        r.evidence[:0] = [_ev(e) for e in evidence if e is not None]
        return r


def _p_kind(facts: TurnFacts, *kinds: str) -> VllmRecord | None:
    return next((r for r in facts.p_records if r.kind in kinds), None)


# P lines that show the request got past WAITING_FOR_REMOTE_KVS (it finished, or is holding blocks for D).
_COMPLETED_KINDS = frozenset({"request_finished_wait", "request_finished_status", "finished_sending",
                              "generated_response"})


def _hung(facts: TurnFacts) -> VllmRecord | None:
    """P's last ``still in WAITING_FOR_REMOTE_KVS`` line if the request never left that state.

    Real vLLM logs that line at DEBUG on every engine step of an ordinary D→P read (about 100 lines for
    a 100 ms read), so the line alone proves nothing: the request hung only if P never finished it and
    no successful receive follows the last such line.
    """
    waits = [r for r in facts.p_records if r.kind == "waiting_remote_kvs"]
    if not waits or any(r.kind in _COMPLETED_KINDS for r in facts.p_records):
        return None
    last = max(waits, key=lambda r: (r.path, r.lineno))
    if any(r.kind == "finished_recving" and (r.path, r.lineno) > (last.path, last.lineno) for r in facts.p_records):
        return None
    return last


def _failed(facts: TurnFacts) -> tuple[str | None, Located | None]:
    """Why the turn itself failed (stock or instrumented), with the line that says so."""
    # The client's own record wins: the router can log a late 499 for a reply the client read in full,
    # and P's failed first attempt (the router retries without the handle) does not fail an answered turn.
    if _answered(facts):
        return None, None
    for ev in (*facts.client_events, *facts.router_events):
        if ev.event.status in FAILED_STATUSES:
            http = f", HTTP {ev.event.http_status}" if ev.event.http_status else ""
            return f"status={ev.event.status}{http}", ev
    hung = _hung(facts)  # once: a real hang logs thousands of WAITING lines
    for rec in (*facts.p_records, *facts.d_records, *facts.other_records):
        why = record_failure(rec)
        if why is not None:
            return why, rec
        if rec.kind == "waiting_remote_kvs" and rec is hung:
            return "never completed: P stuck in WAITING_FOR_REMOTE_KVS (vLLM 0.33 recompute hang)", rec
    if facts.proxy is not None:
        for line in facts.proxy.lines:
            why = proxy_failure(line.kind, line.fields.get("detail"))
            if why is not None:
                return why, line
    return None, None


# vLLM record kinds that say the request itself failed (report_stock.py selects their lines by these).
FAILURE_KINDS = frozenset({"kv_load_failed", "request_failed", "generated_response"})
PROXY_FAILURE_KINDS = frozenset({"prefill_failed", "decode_failed"})


def record_failure(rec: VllmRecord) -> str | None:
    """Why a vLLM line says the request failed (``_failed``'s per-line rule), or None."""
    if rec.kind == "kv_load_failed":
        return "P failed it on KV load failure (failure_policy=fail)"
    if rec.kind == "request_failed":
        return f"vLLM: request failed ({rec.fields.get('why')})"
    if rec.kind == "generated_response" and rec.fields.get("finish_reason") in ("error", "abort"):
        return f"finish_reason={rec.fields['finish_reason']}"
    return None


def proxy_failure(kind: str, detail: str | None) -> str | None:
    """Why a proxy line says the request failed (a failed prefill or decode leg), or None."""
    if kind not in PROXY_FAILURE_KINDS:
        return None
    return f"{kind.replace('_', ' ')}: {detail or ''}"[:200]


def _answered(facts: TurnFacts) -> bool:
    """The client got its answer: its own event says so, or (stock logs) a proof the reply completed.

    vLLM's benchmark writes a RequestStats record only for a valid response, and the proxy stores
    D's handle only from the final chunk of a reply D finished normally.
    """
    if facts.client_events or facts.router_events:
        # kvdiag's own events state the outcome (report's DuckDB path reads them alike)
        return any(ev.event.status == "ok" for ev in facts.client_events)
    proxy = facts.proxy
    if proxy is not None and proxy.stored is not None:
        return True
    # a record beside a proxy that shows the prefill leg failing proves nothing (no such benchmark record)
    return facts.client_stat is not None and (proxy is None or not _prefill_leg_failed(proxy))


def _answer_proof(facts: TurnFacts) -> Located | None:
    if facts.client_events or facts.router_events:
        return next((ev for ev in facts.client_events if ev.event.status == "ok"), None)
    return facts.client_stat or (facts.proxy.stored if facts.proxy is not None else None)


def _with_failure(reason: str, facts: TurnFacts, builder: _Turn) -> str:
    why, line = _failed(facts)
    if why is None:
        retried = next((r for r in facts.p_records if r.kind == "kv_load_failed"), None)
        if retried is None or not _answered(facts):
            return reason
        builder.rec.evidence.append(_ev(retried))
        if facts.client_events or facts.router_events:
            return retried_reason(reason)
        proof = _answer_proof(facts)
        if proof is not None:
            builder.rec.evidence.append(_ev(proof))
        return answered_reason(reason)
    if line is not None:
        builder.rec.evidence.append(_ev(line))
    return f"{reason.rstrip('.')}; the turn failed ({why})"


def retried_reason(reason: str) -> str:
    """The reason of an answered turn whose first P attempt failed on a KV load failure."""
    retry = "" if "retried without the handle" in reason else " after a retry without the handle"
    return (f"{reason.rstrip('.')}; P failed that attempt on KV load failure (failure_policy=fail), yet the "
            f"client got its answer{retry}")


def answered_reason(reason: str) -> str:
    """The reason of a turn P failed on a KV load failure that the client still got (stock logs).

    A stock proxy given no kv_transfer_params by P goes on to D with the request as it was, D's own
    handle from the previous turn included, and D computes the prompt itself.
    """
    return (f"{reason.rstrip('.')}; P failed that prefill on KV load failure (failure_policy=fail), yet the "
            "client got its answer: the decode leg went ahead without P's KV")


# A fix per missing-metadata cause named in the reason (first match wins: a failed turn may say "aborted").
_METADATA_FIXES = (
    ("not_streamed", "Run vLLM with PR #40186 (streamed responses then return kv_transfer_params) or send "
                     "non-streamed requests."),
    ("bidirectional_off_on_decode", "Set bidirectional_kv_xfer: true in D's kv_connector_extra_config; restart D."),
    ("decode_failed", "Fix the previous turn's failure (see its reason): a failed turn stores no handle."),
    ("prefill_failed", "Fix the previous turn's failure (see its reason): a failed turn stores no handle."),
    ("client_disconnected", "The client left before the previous reply ended, so D's handle never reached the "
                            "router: nothing to tune unless disconnects are common."),
    ("aborted", "The previous turn was aborted (client cancel or timeout): nothing to tune unless aborts are common."),
)


def _fix_hint(rec: TurnRecord, ctx: Context) -> None:
    if rec.verdict is Verdict.METADATA_NOT_RETURNED:
        rec.fix = next((fix for token, fix in _METADATA_FIXES if token in rec.reason), rec.fix)
    elif rec.verdict is Verdict.UNKNOWN and "VLLM_LOGGING_LEVEL=DEBUG" in rec.reason:
        rec.fix = ("Run P with VLLM_LOGGING_LEVEL=DEBUG, or load kvdiag's connector on P (docs/connector.md) for "
                   "prefill events.")
    elif rec.verdict is Verdict.EXPIRED_REMOTE_READ and rec.gap_s is not None:
        ttl = ctx.decode_ttl_s or DEFAULT_DECODE_TTL_S
        assumed = "" if ctx.decode_ttl_s else " (vLLM's default; D's startup line was not in the logs)"
        if rec.gap_s >= ttl - 5:
            rec.fix = (f"gap {rec.gap_s:.0f} s vs decoder_kv_blocks_ttl {ttl:.0f} s{assumed} (P declines within 5 s "
                       "of expiry): raise the TTL or expect recompute")
        else:  # the gap does not explain it: a shorter real TTL, or P's clock ahead of D's
            real_ttl = "D's real TTL (its 'Bidirectional KV transfer is enabled' line) and " if assumed else ""
            rec.fix = (f"gap {rec.gap_s:.0f} s is well inside decoder_kv_blocks_ttl {ttl:.0f} s{assumed}: check "
                       f"{real_ttl}the clock sync (NTP) of P and D: P judges D's expiry time by its own clock")
    elif rec.verdict is Verdict.ROUTER_ENTRY_EXPIRED and rec.entry_age_s is not None and ctx.router_ttl_s:
        rec.fix = (f"entry age {rec.entry_age_s:.1f} s > router TTL {ctx.router_ttl_s:g} s: raise the router TTL "
                   "(keep it below decoder_kv_blocks_ttl − 5 s) or expect recompute")


def classify_turn(facts: TurnFacts, earlier: list[TurnFacts], ctx: Context) -> TurnRecord:
    """Classify one turn; ``earlier`` are the conversation's earlier turns, in order."""
    b = _Turn(facts)
    rec = _instrumented(facts, b) or _stock(facts, earlier, ctx, b)
    if rec.gap_s is None and earlier:
        rec.gap_s = _client_gap(earlier[-1].client_stat, facts.client_stat)
    _fix_hint(rec, ctx)
    return rec


def _client_gap(prev: ClientStat | None, cur: ClientStat | None) -> float | None:
    """Seconds between the previous reply's end and this request, from the benchmark's own clock."""
    if prev is None or cur is None:
        return None
    start, latency, now = prev.start_time_ms, prev.latency_ms, cur.start_time_ms
    if start is None or latency is None or now is None:
        return None
    gap = (now - start - latency) / 1000.0
    return round(gap, 3) if gap >= 0 else None


def _inferred_by_router(ev: EventRecord) -> bool:
    return (ev.event.reason or "").startswith("inferred")


def _instrumented(facts: TurnFacts, b: _Turn) -> TurnRecord | None:
    """The outcome recorded by the router (merged with P's report), or by P, when present.

    A router outcome the router itself marks ``inferred:`` (e.g. it retried P without the handle
    after P failed the request) yields to the outcome P's connector recorded for the same request:
    on real vLLM an expired read declined by P reaches the router only as a failed prefill leg.
    """
    observed = [e for e in facts.prefill_events if e.event.outcome not in (None, Verdict.UNKNOWN.value)]
    for group in (facts.router_events, facts.prefill_events, facts.client_events):
        ev = next((e for e in group if e.event.outcome is not None), None)
        if ev is None or ev.event.outcome is None:
            continue
        if group is facts.router_events and _inferred_by_router(ev) and observed:
            ev = observed[0]
        verdict = Verdict(ev.event.outcome or Verdict.UNKNOWN.value)
        if verdict is Verdict.UNKNOWN:
            continue
        reason = ev.event.reason or VERDICT_INFO[verdict].summary
        if ev.event.failure_type and ev.event.failure_type not in reason:
            reason += f" (failure_type={ev.event.failure_type})"
        if verdict is not Verdict.REQUEST_FAILED:
            reason = _with_failure(reason, facts, b)
        extra = [e for e in (*facts.prefill_events, *facts.decode_events) if e is not ev][:3]
        stock = [r for r in facts.p_records if r.kind][:3] + facts.released_handle[:1]
        # an outcome its recorder only inferred is no proof, whatever the source
        confidence = INFERRED if _inferred_by_router(ev) else CONFIRMED
        return b.set(verdict, confidence, reason, ev, *extra, *stock)
    return None


def _stock(facts: TurnFacts, earlier: list[TurnFacts], ctx: Context, b: _Turn) -> TurnRecord:
    """Rules over stock logs (vLLM text logs, proxy log, benchmark stats)."""
    prev = earlier[-1] if earlier else None
    proxy = facts.proxy
    if proxy is not None and proxy.lookup == "no_conversation_id":
        return b.set(Verdict.NO_CONVERSATION_ID, CONFIRMED, _with_failure(
            "the proxy got no conversation_id, so it could not link the turns", facts, b), proxy.lines[0])
    if proxy is not None and proxy.lookup == "stale":
        head = proxy.lines[0]
        return b.set(Verdict.ROUTER_ENTRY_EXPIRED, CONFIRMED, _with_failure(
            f"router entry age {head.fields['age']} s > ttl {head.fields['ttl']} s: discarded", facts, b), head)
    if proxy is not None and proxy.lookup == "hit":
        return _handle_offered(facts, prev, ctx, b)
    first = facts.turn == 1 and (prev is None) and (
        proxy is not None or (facts.client_stat is not None and (facts.client_stat.input_num_turns or 1) <= 2))
    failed_why, failed_line = _failed(facts)
    if first:
        if failed_why is not None:
            return b.set(Verdict.REQUEST_FAILED, CONFIRMED, f"turn 1 failed: {failed_why}", failed_line)
        if _prefill_leg_failed(proxy):
            return b.set(Verdict.REQUEST_FAILED, INFERRED, "turn 1 failed: the proxy logged no 'Prefill done' "
                         "for it (the prefill leg failed)", *(proxy.lines[:1] if proxy else []))
        # The client's message count proves turn 1; the proxy's order only suggests it (rotated logs).
        stat = facts.client_stat
        conf = CONFIRMED if stat is not None and stat.input_num_turns is not None and stat.input_num_turns <= 2 \
            else INFERRED
        return b.set(Verdict.FIRST_TURN, conf, "first turn of the conversation: nothing to retrieve yet",
                     *(proxy.lines[:1] if proxy else []), facts.client_stat)
    if proxy is not None and proxy.lookup in ("miss", "no_handle"):
        if earlier and all((_failed(e)[0] is not None or _prefill_leg_failed(e.proxy))
                           and (e.proxy is None or e.proxy.stored is None) for e in earlier):
            # nothing was ever answered: the request carries no earlier reply, as on turn 1
            return b.set(Verdict.FIRST_TURN, INFERRED, "every earlier request of the conversation failed: "
                         "nothing to retrieve yet", miss_line(proxy), earlier[-1].proxy.lines[0]
                         if earlier[-1].proxy else None)
        return _no_handle(facts, prev, ctx, b)
    if proxy is None and ctx.has_router:
        if facts.client_stat is not None:
            return b.set(Verdict.NO_CONVERSATION_ID, INFERRED,
                         "no router/proxy line names this conversation: the client most likely sent no "
                         "conversation_id (the proxy log then shows '[id] No conversation_id provided')",
                         facts.client_stat)
    if failed_why is not None:
        return b.set(Verdict.REQUEST_FAILED, CONFIRMED, f"the turn failed: {failed_why}", failed_line)
    missing = "the router's proxy log (--proxy-log) or router events" if not ctx.has_router else "P's log"
    return b.set(Verdict.UNKNOWN, INFERRED, f"the logs given cannot decide this turn: add {missing}",
                 facts.client_stat)


def _prefill_leg_failed(proxy: ProxyRequest | None) -> bool:
    """The proxy logs "[id] Prefill done in N ms" once P answered; without it the P leg failed."""
    return proxy is not None and proxy.stored is None and not any(ln.kind == "prefill_done" for ln in proxy.lines)


def miss_line(proxy: ProxyRequest) -> ProxyRecord:
    """The proxy line that says no handle was sent."""
    return next((ln for ln in proxy.lines if ln.kind in ("miss", "no_handle")), proxy.lines[-1])


def _handle_offered(facts: TurnFacts, prev: TurnFacts | None, ctx: Context, b: _Turn) -> TurnRecord:
    """The router handed D's params to P: P's log decides (Contract 4 rules 1–7)."""
    assert facts.proxy is not None
    sent = facts.proxy.lines[-1] if facts.proxy.lines else None
    sent = next((ln for ln in facts.proxy.lines if ln.kind == "sending"), sent)
    decl = _p_kind(facts, "declining_expired")
    if decl is not None:
        return b.set(Verdict.EXPIRED_REMOTE_READ, CONFIRMED, _with_failure(
            "P declined the D→P read: D's blocks expire within 5 s or already did", facts, b),
            sent, decl, *facts.released_handle[:1])
    fail = next((r for r in facts.p_records if r.kind == "nixl_failure"
                 and r.fields["context"].get("request_id") is not None), None) or _p_kind(facts, "nixl_failure")
    if fail is not None:
        ftype = str(fail.fields["failure_type"])
        b.rec.failure_type = ftype
        return b.set(Verdict.TRANSFER_FAILED, CONFIRMED, _with_failure(
            f"the D→P read failed: NIXL {ftype}", facts, b), sent, fail)
    if facts.stale_read:
        return b.set(Verdict.EXPIRED_REMOTE_READ, CONFIRMED, _with_failure(
            "D logged that the blocks offered to this turn were read after it had released them (Potentially "
            "invalid KV blocks): the KV P loaded is not D's", facts, b), sent, facts.stale_read[0])
    skip = _p_kind(facts, "skip_remote_pull")
    if skip is not None:
        n, thr = int(skip.fields["remote_tokens"]), int(skip.fields["threshold"])
        b.rec.remote_offered_tokens = n
        if n < ctx.block_size:
            return b.set(Verdict.LOCAL_HIT, CONFIRMED, f"P's prefix cache held all but {n} token(s) (< one block of "
                         f"{ctx.block_size}); nothing left to pull", sent, skip)
        return b.set(Verdict.BELOW_THRESHOLD, CONFIRMED,
                     f"{n} remote tokens < kv_recompute_threshold {thr}: P recomputed them", sent, skip)
    if facts.released_handle and _failed(facts)[0] is None:
        rel = facts.released_handle[0]
        if not ctx.has_prefill:
            return b.set(Verdict.EXPIRED_REMOTE_READ, INFERRED, "D released the blocks offered to this turn "
                         "unread (TTL); P's log would show the declined read", sent, rel)
        # P declines (WARNING) or fails (ERROR) a read it attempts, visible at INFO: no such line and
        # D's blocks expired unread means P never tried.
        return b.set(Verdict.FEATURE_DISABLED_ON_PREFILL, INFERRED, "D's blocks offered to this turn expired "
                     "unread and P logged no read attempt: P ignored the handle", sent, rel)
    load_fail = _p_kind(facts, "kv_load_failed")
    if load_fail is not None:
        return b.set(Verdict.TRANSFER_FAILED, INFERRED, "P failed the request on a KV load failure with no "
                     "expiry line; failure_type unknown at this log level; the turn failed", sent, load_fail)
    hang = _hung(facts)
    if hang is not None:
        return b.set(Verdict.UNKNOWN, INFERRED, "P stuck in WAITING_FOR_REMOTE_KVS after a D→P read (vLLM 0.33 "
                     "recompute hang); the turn never completed; P's WARNING lines decide the cause", sent, hang)
    read = _p_kind(facts, "read_blocks", "finished_recving")
    if read is not None:
        return b.set(Verdict.REMOTE_HIT, CONFIRMED, _with_failure("P read D's blocks (D→P)", facts, b), sent, read)
    start = _p_kind(facts, "start_load_kv")
    if start is not None and int(start.fields["local_blocks"]) > 0:
        return b.set(Verdict.REMOTE_HIT, CONFIRMED, _with_failure(
            f"P started the D→P read of {start.fields['remote_blocks']} block group(s)", facts, b), sent, start)
    if start is not None:
        # vLLM hands the worker a request with no local block to fill when P's prefix cache already
        # holds every token the handle covers (a skip under the threshold logs its own line, above):
        # the worker only tells D to release its blocks.
        return b.set(Verdict.LOCAL_HIT, CONFIRMED, _with_failure(
            "P's prefix cache already held every token of D's handle: P's read had no block to fill "
            "(start_load_kv with 0 local blocks) and only told D to release its blocks", facts, b), sent, start)
    if ctx.p_bidir is False and ctx.d_bidir:
        return b.set(Verdict.FEATURE_DISABLED_ON_PREFILL, INFERRED,
                     "D logs 'Bidirectional KV transfer is enabled' but P does not: P ignored D's handle", sent)
    why, line = _failed(facts)
    if why is not None:
        return b.set(Verdict.REQUEST_FAILED, CONFIRMED, f"D's handle was offered, but the turn failed: {why}",
                     sent, line)
    if not ctx.has_prefill:
        return b.set(Verdict.UNKNOWN, INFERRED, "the proxy offered D's handle to P; P's log decides what P did "
                     "with it (add the prefill log)", sent)
    if ctx.p_debug:
        # at DEBUG P logs every D->P decision (read, skip, decline, failure); none at all: it ignored the handle
        return b.set(Verdict.FEATURE_DISABLED_ON_PREFILL, INFERRED, "P's DEBUG log shows no D→P read, skip, "
                     "decline or failure for this request: P ignored D's handle (bidirectional_kv_xfer off on P)",
                     sent, *facts.p_records[:1])
    if _prefill_leg_failed(facts.proxy):
        return b.set(Verdict.REQUEST_FAILED, INFERRED, "the proxy logged no 'Prefill done' for it and P logged "
                     "no D→P decline or failure: the prefill leg failed for another reason", sent)
    decided = _by_windows(facts, prev, ctx, b, sent)
    if decided is not None:
        return decided
    tail = ("; the proxy stored no handle after it, so the turn may have failed downstream (vLLM logs request "
            "failures only with --enable-log-requests)" if facts.proxy.stored is None else "")
    found = ctx.windows.finding(facts.proxy.rid) if ctx.windows is not None else None
    if found is not None and found.rejected is not None:
        return b.set(Verdict.UNKNOWN, INFERRED, f"the proxy offered D's handle and {found.why}{tail}", sent,
                     found.rejected)
    windows = f"; {found.why}" if found is not None else ""
    return b.set(Verdict.UNKNOWN, INFERRED, "the proxy offered D's handle and P logged no failure: remote_hit, "
                 f"local_hit or below_threshold{windows}. Stock vLLM logs nothing per request for these at INFO — "
                 f"run P at VLLM_LOGGING_LEVEL=DEBUG or add prefill events to decide{tail}", sent,
                 *(w.evidence for w in (found.windows[:2] if found is not None else ())))


def _by_windows(facts: TurnFacts, prev: TurnFacts | None, ctx: Context, b: _Turn, sent: Located | None
                ) -> TurnRecord | None:
    """P at INFO: what P's stats windows and the token counts prove about this turn's read (docs/verdicts.md)."""
    assert facts.proxy is not None
    rid = facts.proxy.rid
    if ctx.windows is None:
        ctx.window_wanted.add(rid)  # explain reads the stats windows and classifies again
        return None
    found = ctx.windows.finding(rid)
    if found is None or found.rejected is not None:
        return None
    lines = [w.evidence for w in found.windows[:3]]
    if found.read:
        return b.set(Verdict.REMOTE_HIT, INFERRED, _with_failure(found.why, facts, b), sent, *lines)
    if ctx.p_bidir is not True or found.prefix_caching is not False:
        # P may have ignored the handle (its startup line would say), or held it all locally: DEBUG decides
        return None
    # Without prefix caching nothing is held locally: P pulls min(D's tokens, the prompt) unless that is
    # below kv_recompute_threshold, and logs every read it starts and does not finish.
    low, thr = _remainder_floor(facts, prev), ctx.threshold
    must_read = low is not None and thr is not None and low >= thr + TOKEN_MARGIN
    caching = ctx.windows.caching_line
    if found.read is False and not must_read:
        t = f" {thr}" if thr is not None else ""
        return b.set(Verdict.BELOW_THRESHOLD, INFERRED, _with_failure(
            f"{found.why}; P runs without prefix caching, so nothing was held locally: the remainder was below "
            f"kv_recompute_threshold{t} and P recomputed it", facts, b), sent, *lines, caching)
    recovered = ctx.windows.recovered_near(rid)
    done = any(ln.kind == "prefill_done" for ln in facts.proxy.lines)
    # Only where no stats window speaks: a window that counts fewer transfers than the reads sharing it
    # says some read made none, and this turn alone cannot tell which one.
    if found.read is None and not found.windows and must_read and done and recovered is None:
        return b.set(Verdict.REMOTE_HIT, INFERRED, _with_failure(
            f"P runs without prefix caching, so it had to pull all of D's tokens the prompt repeats, at least {low} "
            f"by the client's counts, which is not below kv_recompute_threshold {thr}; P logged no decline, failure "
            "or recovery for the read and answered the prefill: the read succeeded", facts, b),
            sent, caching, prev.client_stat if prev is not None else None, facts.client_stat)
    return None


def _remainder_floor(facts: TurnFacts, earlier: TurnFacts | None) -> int | None:
    """A lower bound of D's tokens P could pull with nothing held locally, from the benchmark's counts.

    D's handle covers the previous prompt and reply (``input_num_tokens`` and ``output_num_tokens`` of
    the previous record count message content only, so they bound it from below); P pulls at most
    the new prompt, of which the content alone is ``input_num_tokens``.
    """
    prev, cur = (earlier.client_stat if earlier is not None else None), facts.client_stat
    if prev is None or cur is None or None in (prev.input_num_tokens, prev.output_num_tokens, cur.input_num_tokens):
        return None
    # message boundaries tokenize a little differently inside a chat template: a token or two each
    slack = 2 * (cur.input_num_turns or 1)
    return min((prev.input_num_tokens or 0) + (prev.output_num_tokens or 0) - 1, cur.input_num_tokens or 0) - slack


def _no_handle(facts: TurnFacts, prev: TurnFacts | None, ctx: Context, b: _Turn) -> TurnRecord:
    """A later turn the router sent without a handle: why was there none?"""
    assert facts.proxy is not None
    miss = facts.proxy.lines[-1]
    miss = next((ln for ln in facts.proxy.lines if ln.kind in ("miss", "no_handle")), miss)
    # Later revisions of the example proxy check the history themselves and say when they hold a handle back.
    if facts.proxy.withheld is not None:
        why = facts.proxy.withheld.fields.get("why") or "history changed"
        return b.set(Verdict.PREFIX_MISMATCH, CONFIRMED, _with_failure(
            f"the proxy held D's handle back: {why} (the new prompt does not extend what D's blocks hold)",
            facts, b), facts.proxy.withheld, miss)
    if prev is not None and prev.proxy is not None and prev.proxy.not_stored is not None:
        line = prev.proxy.not_stored
        why = (line.fields.get("why") or "").strip().removeprefix("because ").strip() or "no reason given"
        return b.set(Verdict.PREFIX_MISMATCH, CONFIRMED, _with_failure(
            f"the proxy did not keep turn {prev.turn}'s handle ({why}), so it offered none", facts, b), line, miss)
    if facts.concurrent and prev is not None:
        return b.set(Verdict.CONCURRENT_TURN, INFERRED, _with_failure(
            f"turn {prev.turn} was still in flight (its D handle was stored after this request arrived)", facts, b),
            miss)
    if prev is not None and prev.proxy is not None and prev.proxy.stored is not None:
        if facts.restart_before is not None:
            return b.set(Verdict.ROUTER_STATE_LOST, CONFIRMED, _with_failure(
                f"the proxy stored turn {prev.turn}'s handle, then restarted ('Ready' line) and lost it",
                facts, b), prev.proxy.stored, facts.restart_before, miss)
        # The stock proxy pops an entry only on a HIT; kvdiag's router may also withhold it (prefix_mismatch).
        return b.set(Verdict.UNKNOWN, INFERRED, _with_failure(
            f"the proxy stored turn {prev.turn}'s handle, but this turn was a MISS with no stale or restart line: "
            "router_state_lost (another replica) or a handle the router withheld (prefix_mismatch); router "
            "events decide", facts, b), prev.proxy.stored, miss)
    if prev is not None:
        return _metadata_not_returned(facts, prev, ctx, b, miss)
    return b.set(Verdict.UNKNOWN, INFERRED, "a later turn without a handle, and the previous turn is not in the "
                 "logs: add the earlier proxy log (rotated file) or router events", miss)


def _metadata_not_returned(facts: TurnFacts, prev: TurnFacts, ctx: Context, b: _Turn, miss: Located
                           ) -> TurnRecord:
    for rec in prev.d_records + prev.p_records + prev.other_records:
        if rec.kind == "aborted":
            return b.set(Verdict.METADATA_NOT_RETURNED, CONFIRMED, _with_failure(
                f"turn {prev.turn} was aborted, so D returned no kv_transfer_params (aborted)", facts, b), rec, miss)
    why, line = _failed(prev)
    if why is not None:
        return b.set(Verdict.METADATA_NOT_RETURNED, CONFIRMED, _with_failure(
            f"turn {prev.turn} failed ({why}), so no handle was stored (decode_failed)", facts, b), line, miss)
    if ctx.d_bidir is False:
        return b.set(Verdict.METADATA_NOT_RETURNED, INFERRED, _with_failure(
            f"the proxy stored no handle after turn {prev.turn} and D's log has no 'Bidirectional KV transfer is "
            "enabled' line: bidirectional KV transfer is off on D (bidirectional_off_on_decode)", facts, b), miss)
    if ctx.d_bidir:
        return b.set(Verdict.METADATA_NOT_RETURNED, INFERRED, _with_failure(
            f"D has bidirectional on, yet the proxy stored no handle after turn {prev.turn}: the streamed "
            "response carried no kv_transfer_params, as vLLM without PR #40186 does (not_streamed)", facts, b), miss)
    return b.set(Verdict.METADATA_NOT_RETURNED, INFERRED, _with_failure(
        f"the proxy stored no handle after turn {prev.turn}; D's log would say why (bidirectional off, abort)",
        facts, b), miss)
