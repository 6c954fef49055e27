"""What every turn's records say, one row per turn (``turn_facts``), in DuckDB: the inputs of the verdict rules.

Each column is one fact a rule reads (diagnostics/rules.py), taken from the records engine_join put in
the turn: the turn's numbers (client first: its events, then its statistics, then the router and P),
the deciding event of an instrumented turn, the proxy's lookup and lines, P's and D's lines for the
request, and whether and why the turn failed. A line a rule may cite is a *ref*, ``(f << 40) + n``; the
evidence's ``file:line`` and text are looked up only for the turns explain prints.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Final

from kvdiag.diagnostics.engine_no_events import EventsOnly, EventsUnion
from kvdiag.diagnostics.engine_parse import EVENT_FIELDS, EVENT_ORDER, EVENT_ORDER_LINE, VLLM_COLUMNS, sql_str
from kvdiag.diagnostics.event_table_columns import EVENT_TABLE_COLUMNS

FAILED_STATUSES: Final = ("error", "aborted", "disconnected", "timeout", "hung")
# TurnRecord fields taken from the first event that states them (client, then router, then P).
EVENT_NUMBERS: Final = ("ttft_ms", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                        "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s",
                        "model", "failure_type", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens",
                        "trim_reason", "wrong_kv_tokens", "mismatch_tokens")
# P lines that show a request got past WAITING_FOR_REMOTE_KVS (it finished, or is holding blocks for D)
_COMPLETED_KINDS: Final = ("request_finished_wait", "request_finished_status", "finished_sending",
                           "generated_response")
_KNOWN: Final = "outcome IS NOT NULL AND outcome <> 'unknown'"
REF: Final = "((f::BIGINT << 40) + n)"


# a statistic's place (file, line, record in the line) as one number: arg_max over a struct key costs
# several times more
CS_ORDER: Final = "((j.f::HUGEINT << 96) + (j.n::HUGEINT << 48) + j.sub)"
# the client statistics' numbers a turn takes (from its last statistic), as s_<name>
_STAT_NUMBERS: Final = ("ttft_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
                        "output_num_tokens")

# a proxy request's last line: the last of its own lines, its stored handle and a "not caching" line naming no
# request
_PX_LAST: Final = "greatest(p.last_seq, p.stored_seq, CASE WHEN nc.by_conv THEN nc.seq END)"

def _first(expr: str, order: str, where: str) -> str:
    return f"arg_min({expr}, {order}) FILTER (WHERE {where})"


# the event columns ev_facts and decider read (tev_r carries no others: it holds a row per turn event)
_TEV_COLUMNS: Final = tuple(dict.fromkeys(("f", "n", "ts", "status", "http_status", "outcome", "reason",
                                           "engine_request_id", "remote_read_tokens", "duration_ms",
                                           *EVENT_NUMBERS)))


def facts_sql(vl_kinds: Collection[str] | None = None, event_columns: Collection[str] | None = None) -> list[str]:
    """The statements that build ``turn_facts`` (after engine_join); ``vl_kinds``: the kinds ``vl`` holds, and
    ``event_columns``: the event fields some event sets, when known (a fact that only lines of other kinds, or
    only fields no event sets, could give is left out of the pass over the lines or the events)."""
    cols = ", ".join(f"e.{c}" for c in _TEV_COLUMNS)
    unset = frozenset() if event_columns is None else frozenset(EVENT_FIELDS).difference(event_columns)
    return [
        # turns with more than one client or router event, or with engine events (few): their events are
        # aggregated; the others pair their client and router event by a join (ev_facts)
        EventsOnly("""CREATE TEMP TABLE tev_multi AS SELECT sid FROM (
             SELECT sid, CASE WHEN pass IN (1, 2) THEN 0 ELSE 1 END AS grp FROM ev_slot
             UNION ALL SELECT sid, 2 FROM eng_slot) GROUP BY sid
           HAVING count(*) FILTER (WHERE grp = 0) > 1 OR count(*) FILTER (WHERE grp = 1) > 1
             OR count(*) FILTER (WHERE grp >= 2) > 0"""),
        # the events of those turns in the order the rules read them: client, router, P (each in file order), D
        EventsOnly(f"""CREATE TEMP TABLE tev_r AS
           SELECT {cols}, s.sid, CASE e.source WHEN 'client' THEN 0 ELSE 1 END AS grp, {_ev_order('e.source')} AS o
           FROM ev_slot s JOIN ev e USING (f, n, sub) WHERE s.sid IN (SELECT sid FROM tev_multi)
           UNION ALL SELECT {cols}, s.sid, CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END,
             {EVENT_ORDER.format(order="(CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END::BIGINT << 58) + "
                                       + REF.replace('f', 'e.f').replace('+ n', '+ e.n'), sub="e.sub")}
           FROM eng_slot s JOIN ev e USING (f, n, sub) WHERE s.sid IN (SELECT sid FROM tev_multi)"""),
        _ev_facts_sql(cols, unset),
        # the deciding event: a paired turn's is in ev_facts already (its dec_ columns, dropped after)
        EventsOnly(f"""CREATE TEMP TABLE decider AS
           WITH pick AS (SELECT sid, eng_os, CASE
               WHEN r_first IS NOT NULL AND r_inferred AND p_known IS NOT NULL THEN p_known
               WHEN r_first IS NOT NULL AND r_outcome <> 'unknown' THEN r_first
               WHEN p_first IS NOT NULL AND p_first = p_known THEN p_first
               WHEN c_first IS NOT NULL THEN c_first END AS dec_o FROM ev_facts
             WHERE (r_first IS NOT NULL OR p_first IS NOT NULL OR c_first IS NOT NULL)
               AND sid IN (SELECT sid FROM tev_multi))
           SELECT p.sid, t.outcome AS dec_verdict, t.reason AS dec_reason, t.failure_type AS dec_ft,
             starts_with(coalesce(t.reason, ''), 'inferred') AS dec_inferred,
             {REF.replace('f', 't.f').replace('+ n', '+ t.n')} AS dec_ref,
             list_transform(list_filter(p.eng_os, lambda x: x <> p.dec_o)[1:3],
                            lambda x: {EVENT_ORDER_LINE.format(x="x")}) AS eng_refs
           FROM pick p JOIN tev_r t ON t.sid = p.sid AND t.o = p.dec_o
           WHERE t.outcome IS NOT NULL AND t.outcome <> 'unknown'
           UNION ALL SELECT sid, dec_verdict, dec_reason, dec_ft, starts_with(coalesce(dec_reason, ''), 'inferred'),
             dec_ref, NULL::BIGINT[] FROM ev_facts WHERE dec_verdict <> 'unknown'"""),
        *(f"ALTER TABLE ev_facts DROP COLUMN {c}" for c in _DEC_COLUMNS),
        # ---- the proxy's request (engine_join folds its lines into px_slot; a line's place is its ref): the last
        # line is the last of its own lines, its stored handle and a "not caching" line naming no request
        f"""CREATE TEMP VIEW px_facts AS
            SELECT p.sid, p.rid AS px_rid, p.seq AS px_seq, p.po AS px_po, p.lookup AS px_lookup, p.stored_seq,
              p.stored_po AS px_stored_po,
              p.head_age AS px_age, p.head_ttl AS px_ttl, p.first_ref AS px_first,
              {_PX_LAST} AS px_last, ({_PX_LAST} >> 40)::INTEGER AS px_last_f,
              p.first_ts AS px_first_ts, p.sending AS px_sending, p.miss AS px_miss, p.prefill_ms AS px_prefill_ms,
              p.done AS px_done, p.failed_why AS px_failed_why, p.failed_ref AS px_failed_ref,
              p.withheld AS px_withheld, p.withheld_why AS px_withheld_why, p.stored_seq AS px_stored,
              nc.seq AS px_not_stored, nc.why AS px_not_stored_why, p.offered AS px_offered
            FROM px_slot p
            LEFT JOIN px_not_cached nc ON nc.rid = p.rid""",
        _vl_facts_sql(vl_kinds),
        # ---- one row per turn
        f"""CREATE TEMP VIEW turn_facts AS
           SELECT s.sid, s.conv AS conversation_id, s.turn, s.rid AS request_id,
             e.* EXCLUDE (sid), d.* EXCLUDE (sid), p.* EXCLUDE (sid), v.* EXCLUDE (sid),
             {", ".join(f"c.{c} AS s_{c}" for c in _STAT_NUMBERS)}, c.ref AS stat_ref, c.ref IS NOT NULL AS has_stat
           FROM slots s LEFT JOIN ev_facts e USING (sid) LEFT JOIN decider d USING (sid)
           LEFT JOIN px_facts p USING (sid) LEFT JOIN vl_facts v USING (sid)
           LEFT JOIN ({_stats_sql()}) c USING (sid)""",
    ]


def _stats_sql() -> str:
    """Each turn's numbers from its last client statistic (of each that has one) and the last one's ref."""
    cols = ", ".join(_STAT_NUMBERS)
    last = ", ".join(f"arg_max(j.{c}, {CS_ORDER}) AS {c}" for c in _STAT_NUMBERS)
    # (a NULL sid joins no turn; without it, NOT IN below cannot meet a NULL)
    return f"""WITH j AS (SELECT s.sid, cs.f, cs.n, cs.sub, {", ".join(f"cs.{c}" for c in _STAT_NUMBERS)}
                            FROM cs_slot s JOIN cs USING (f, n, sub) WHERE s.sid IS NOT NULL),
                      {_one_or_grouped("c", "j", f"{cols}, (f::BIGINT << 40) + n AS ref",
                                       f"{last}, max((j.f::BIGINT << 40) + j.n) AS ref")}
                    SELECT * FROM c"""


def _one_or_grouped(name: str, rows: str, single: str, grouped: str) -> str:
    """WITH items ``<name>_multi`` and ``<name>``: one row per sid of ``rows``, a sid with one row taking
    ``single`` (its columns as they are: an aggregate of one value is the value), one with several ``grouped``
    (the aggregates). Grouping every sid costs about twice as much, and most have one row."""
    return (f"{name}_multi AS (SELECT sid FROM {rows} GROUP BY sid HAVING count(*) > 1), "
            f"{name} AS (SELECT sid, {grouped} FROM {rows} WHERE sid IN (SELECT sid FROM {name}_multi) GROUP BY sid "
            f"UNION ALL SELECT sid, {single} FROM {rows} WHERE sid NOT IN (SELECT sid FROM {name}_multi))")

def _ev_fact_specs() -> list[tuple[str, str, str, str]]:
    """(column, how, value, where) of ``ev_facts``: how is ``first`` / ``last`` (the value of the first / last
    event in the turn's order ``o`` among those where ``where`` holds and the value is not NULL) or ``any``."""
    failed = ", ".join(map(sql_str, FAILED_STATUSES))
    return [
        ("client_ok", "any", "true", "grp = 0 AND status = 'ok'"),
        ("client_ok_ref", "first", REF, "grp = 0 AND status = 'ok'"),
        ("e_ts", "first", "ts", "grp < 3"),
        *((f"e_{c}", "first", c, f"grp < 3 AND {c} IS NOT NULL") for c in EVENT_NUMBERS),
        ("e_remote_tokens", "first", "remote_read_tokens", "grp < 3 AND remote_read_tokens IS NOT NULL"),
        ("e_latency_ms", "first", "duration_ms", "grp < 3 AND duration_ms IS NOT NULL"),
        ("c_ttft_ms", "first", "ttft_ms", "grp = 0 AND ttft_ms IS NOT NULL"),
        ("c_prompt_tokens", "first", "prompt_tokens", "grp = 0 AND prompt_tokens IS NOT NULL"),
        ("c_completion_tokens", "first", "completion_tokens", "grp = 0 AND completion_tokens IS NOT NULL"),
        ("c_latency_ms", "first", "duration_ms", "grp = 0 AND duration_ms IS NOT NULL"),
        ("c_status", "last", "status", "grp = 0 AND status IS NOT NULL"),
        ("bad_status", "last", "status", "grp < 3 AND status IS NOT NULL AND status <> 'ok'"),
        ("first_status", "first", "status", "grp < 3 AND status IS NOT NULL"),
        ("prefill_request_id", "last", "engine_request_id", "grp = 2 AND engine_request_id <> ''"),
        ("decode_request_id", "last", "engine_request_id", "grp = 3 AND engine_request_id <> ''"),
        ("ev_failed_why", "first", "'status=' || status || CASE WHEN coalesce(http_status, 0) <> 0 THEN ', HTTP ' "
         "|| http_status ELSE '' END", f"grp IN (0, 1) AND status IN ({failed})"),
        ("ev_failed_ref", "first", REF, f"grp IN (0, 1) AND status IN ({failed})"),
        # the deciding event (the router's first outcome, unless only inferred while P states one; then P's;
        # then the client's)
        ("r_first", "first", "o", "grp = 1 AND outcome IS NOT NULL"),
        ("r_outcome", "first", "outcome", "grp = 1 AND outcome IS NOT NULL"),
        ("r_inferred", "first", "starts_with(coalesce(reason, ''), 'inferred')", "grp = 1 AND outcome IS NOT NULL"),
        ("p_known", "first", "o", f"grp = 2 AND {_KNOWN}"),
        ("p_first", "first", "o", "grp = 2 AND outcome IS NOT NULL"),
        ("c_first", "first", "o", "grp = 0 AND outcome IS NOT NULL"),
    ]


_GRP_TEST: Final = re.compile(r"grp (=|<|IN) (\d|\([0-9, ]+\))")


def _grp_holds(where: str, grp: int) -> bool:
    """Whether an ev_facts condition (it starts with a test of ``grp``) can hold for an event of group grp."""
    m = _GRP_TEST.match(where)
    assert m is not None, where
    values = [int(x) for x in m.group(2).strip("()").split(",")]
    return grp in values if m.group(1) != "<" else grp < values[0]


def _ev_order(source: str) -> str:
    # a client or router event's place among its turn's events (P's and D's follow)
    grp = f"CASE {source} WHEN 'client' THEN 0 ELSE 1 END"
    return EVENT_ORDER.format(order=f"({grp}::BIGINT << 58) + (coalesce(s.pass, 3)::BIGINT << 54) + "
                                   "((e.f::BIGINT << 40) + e.n)", sub="e.sub")


# a paired turn's deciding event (its outcome, reason, failure type, ref): ev_facts carries them for decider
_DEC_COLUMNS: Final = ("dec_verdict", "dec_reason", "dec_ft", "dec_ref")


# a conjunct that no event with the column NULL meets: it compares the column or requires it to be set
_NEEDS_COLUMN: Final = re.compile(r"(\w+) (?:IS NOT NULL$|= |<> |IN \()")


def _never_set(value: str, where: str, unset: Collection[str]) -> bool:
    """Whether a first/last fact is NULL for every turn when the ``unset`` columns are NULL in every event: its
    value is one of them, or a conjunct of its condition needs one (a condition with OR is not looked into)."""
    if value in unset:
        return True
    if " OR " in where:
        return False
    return any((m := _NEEDS_COLUMN.match(c)) is not None and m.group(1) in unset for c in where.split(" AND "))


def _ev_facts_sql(cols: str, unset: Collection[str] = frozenset()) -> str:
    """``ev_facts``: aggregated over the events of the turns in ``tev_multi``; for every other turn (at most one
    client and one router event) the client's row joined to the router's, which gives the same values: the
    client's event comes first in ``o``, and arg_min/arg_max skip NULL values as the CASE below does. A fact
    only fields no event sets (``unset``) could give is NULL, unbound: binding fifty aggregates costs a
    conversation's run 20 ms, and aggregating them a gigabyte of events two seconds."""
    # (typed as a run that binds every fact types it; a fact the generated columns do not hold yet is bound)
    types = dict(EVENT_TABLE_COLUMNS.get("ev_facts", ()))
    specs = [(c, "null" if how != "any" and c in types and _never_set(v, w, unset) else how, v, w)
             for c, how, v, w in _ev_fact_specs()]
    agg = {"first": "arg_min({v}, o) FILTER (WHERE {w})", "last": "arg_max({v}, o) FILTER (WHERE {w})",
           "any": "bool_or({w})", "null": "NULL::{t}"}
    aggregated = ",\n  ".join(agg[how].format(v=v, w=w, t=types.get(c)) + f" AS {c}" for c, how, v, w in specs)

    def per_row(grp: int) -> str:
        # a side carries only the columns its events can set (the others are NULL, or false: pair_value)
        return ", ".join(f"{w} AS {c}" if how == "any" else f"CASE WHEN {w} THEN {v} END AS {c}"
                         for c, how, v, w in specs if how != "null" and _grp_holds(w, grp))

    def pair_value(side: str, grp: int, c: str, how: str, w: str) -> str:
        if how != "null" and _grp_holds(w, grp):
            return f"{side}.{c}"
        return f"CASE WHEN {side}.sid IS NOT NULL THEN false END" if how == "any" else "NULL"

    pair = {"first": "coalesce({c}, {r})", "last": "coalesce({r}, {c})",
            # bool_or: NULL when no row says true or false
            "any": "CASE WHEN {c} IS NOT NULL OR {r} IS NOT NULL THEN coalesce({c}, false) OR coalesce({r}, false) END",
            "null": "NULL::{t}"}
    paired = ",\n  ".join(pair[how].format(c=pair_value("c", 0, c, how, w), r=pair_value("r", 1, c, how, w),
                                           t=types.get(c)) + f" AS {c}" for c, how, _v, w in specs)
    # the events of a paired turn straight from ev (tev_r holds only the aggregated turns' events)
    side = ("SELECT sid, {per_row}, outcome AS d_outcome, reason AS d_reason, failure_type AS d_ft, "
            "(f::BIGINT << 40) + n AS d_ref FROM (SELECT {cols}, s.sid, {grp} AS grp, {o} AS o "
            "FROM (SELECT * FROM ev_slot WHERE {kind} AND sid NOT IN (SELECT sid FROM tev_multi)) s "
            "JOIN ev e USING (f, n, sub) WHERE e.source {op} 'client')")
    c_side = side.format(per_row=per_row(0), cols=cols, grp=0, o=_ev_order("e.source"), op="=",
                         kind="pass IN (1, 2)")
    r_side = side.format(per_row=per_row(1), cols=cols, grp=1, o=_ev_order("e.source"), op="<>",
                         kind="(pass = 0 OR pass IS NULL)")
    # decider's choice for such a turn: the router's outcome unless unknown, else the client's
    unbound = {c for c, how, _v, _w in specs if how == "null"}

    def fact(side: str, c: str) -> str:
        return "NULL" if c in unbound else f"{side}.{c}"

    dec = (f"CASE WHEN {fact('r', 'r_first')} IS NOT NULL AND {fact('r', 'r_outcome')} <> 'unknown' THEN r.{{d}} "
           f"WHEN {fact('c', 'c_first')} IS NOT NULL THEN c.{{d}} END")
    decs = ", ".join(dec.format(d=d) + f" AS {c}" for d, c in zip(("d_outcome", "d_reason", "d_ft", "d_ref"),
                                                                    _DEC_COLUMNS, strict=True))
    pairs = f"""WITH c AS ({c_side}), r AS ({r_side})
      SELECT coalesce(c.sid, r.sid) AS sid, true AS has_events, {paired}, NULL::HUGEINT[] AS eng_os, {decs}
      FROM c FULL JOIN r ON c.sid = r.sid"""
    grouped = f"""SELECT sid, count(*) FILTER (WHERE grp IN (0, 1)) > 0 AS has_events, {aggregated},
        (list(o ORDER BY o) FILTER (WHERE grp >= 2))[1:4] AS eng_os,
        NULL::VARCHAR, NULL::VARCHAR, NULL::VARCHAR, NULL::BIGINT
      FROM tev_r GROUP BY sid"""
    # (a branch whose probe finds no row gives none: one conversation's run inserts only the others)
    return EventsUnion("ev_facts", ((pairs, "SELECT 1 FROM ev_slot WHERE sid NOT IN (SELECT sid FROM tev_multi)"),
                                    (grouped, "SELECT 1 FROM tev_r")))


def _vl_fact_specs() -> list[tuple[str, str, str, str, str]]:
    """(column, how, value, where, order) of ``vl_facts``' pass over a turn's vLLM lines: how is ``min`` / ``max``
    (of the value over the lines where ``where`` holds), ``first`` (the value of the first such line in
    ``order`` that has one), ``first3`` (the first three values, in order) or ``any``. A P line's ``o`` is its
    ref (its group's bits are 0): its first ref is min(o)."""
    p = "grp = 'p' AND kind"
    nixl = "grp = 'p' AND kind = 'nixl_failure'"
    failed = "grp IN ('p', 'd', 'o') AND fwhy IS NOT NULL"
    return [
        ("last_wait", "max", "o", f"{p} = 'waiting_remote_kvs'", ""),
        ("completed", "any", "", f"{p} IN ({', '.join(map(sql_str, _COMPLETED_KINDS))})", ""),
        ("last_recv", "max", "o", f"{p} = 'finished_recving'", ""),
        ("p_first_ref", "min", "o", "grp = 'p'", ""),
        ("p_refs3", "first3", "o", "grp = 'p'", ""),
        ("p_decl", "min", "o", f"{p} = 'declining_expired'", ""),
        ("p_nixl_ctx", "min", "o", f"{nixl} AND ctx_request_id IS NOT NULL", ""),
        ("p_nixl_any", "min", "o", nixl, ""),
        ("p_nixl_ft_ctx", "first", "failure_type", f"{nixl} AND ctx_request_id IS NOT NULL", "o"),
        ("p_nixl_ft_any", "first", "failure_type", nixl, "o"),
        ("p_skip", "min", "o", f"{p} = 'skip_remote_pull'", ""),
        ("p_skip_n", "first", "remote_tokens", f"{p} = 'skip_remote_pull'", "o"),
        ("p_skip_thr", "first", "threshold", f"{p} = 'skip_remote_pull'", "o"),
        ("p_kvfail", "min", "o", f"{p} = 'kv_load_failed'", ""),
        ("p_read", "min", "o", f"{p} IN ('read_blocks', 'finished_recving')", ""),
        ("p_start", "min", "o", f"{p} = 'start_load_kv'", ""),
        ("p_start_local", "first", "local_blocks", f"{p} = 'start_load_kv'", "o"),
        ("p_start_remote", "first", "remote_blocks", f"{p} = 'start_load_kv'", "o"),
        ("released", "min", "ref", "grp = 'released'", ""),
        ("stale_read", "min", "ref", "grp = 'stale'", ""),
        # D's abort first
        ("aborted", "first", "ref", "grp IN ('p', 'd', 'o') AND kind = 'aborted'",
         "(CASE grp WHEN 'd' THEN 0 WHEN 'p' THEN 1 ELSE 2 END::BIGINT << 58) + ref"),
        ("fail_o", "min", "o", failed, ""),
        ("fail_why", "first", "fwhy", failed, "o"),
        ("fail_ref", "first", "ref", failed, "o"),
    ]


def required_kinds(where: str) -> frozenset[str] | None:
    """The kinds a line must have for the condition ``where`` (a conjunction) to hold, or None when it names none."""
    if " OR " in where:
        return None
    for part in where.split(" AND "):
        if m := re.fullmatch(r"kind = '(\w+)'|kind IN \(((?:'\w+', )*'\w+')\)", part):
            return frozenset(re.findall(r"\w+", m.group(1) or m.group(2)))
    return None


def _vl_facts_sql(vl_kinds: Collection[str] | None = None) -> str:
    """``vl_facts``: P's, D's and other engines' lines of each turn. The turns with more than one line are
    aggregated; a turn's single line gives each column by itself (an aggregate of one value is the value). The
    hung line (P's last WAITING_FOR_REMOTE_KVS of a request that never completed) is known only after the pass
    and takes its place among the failure reasons by its ``o``. A fact whose condition needs a kind that is not in
    ``vl_kinds`` holds on no line: it is the value of no line (NULL of its type, false for ``any``), not
    aggregated."""
    specs = _vl_fact_specs()
    agg = {"min": "min({v}) FILTER (WHERE {w})", "max": "max({v}) FILTER (WHERE {w})",
           "first": "arg_min({v}, {o}) FILTER (WHERE {w})", "first3": "list_sort(list({v}) FILTER (WHERE {w}))[1:3]",
           "any": "bool_or({w})"}
    one = {"min": "CASE WHEN {w} THEN {v} END", "max": "CASE WHEN {w} THEN {v} END",
           "first": "CASE WHEN {w} THEN {v} END", "first3": "CASE WHEN {w} THEN [{v}] END", "any": "({w})"}

    def holds_nowhere(where: str) -> bool:
        need = required_kinds(where)
        return vl_kinds is not None and need is not None and not need & set(vl_kinds)

    def none(how: str, v: str) -> str:
        if how == "any":
            return "false"
        typ = {"o": "BIGINT", "ref": "BIGINT", "fwhy": "VARCHAR", **VLLM_COLUMNS}[v]
        return f"NULL::{typ}{'[]' if how == 'first3' else ''}"

    aggregated = ",\n  ".join((none(how, v) if holds_nowhere(w) else agg[how].format(v=v, w=w, o=o)) + f" AS {c}"
                              for c, how, v, w, o in specs)
    per_line = ",\n  ".join((none(how, v) if holds_nowhere(w) else one[how].format(v=v, w=w)) + f" AS {c}"
                            for c, how, v, w, _o in specs)
    ref = REF.replace("f", "v.f").replace("+ n", "+ v.n")
    hung = "p_hung < coalesce(fail_o, p_hung + 1)"
    return f"""CREATE TEMP TABLE vl_facts AS
      WITH v AS MATERIALIZED (SELECT s.sid, s.grp, v.kind, v.ctx_request_id, v.failure_type, v.remote_tokens,
          v.threshold, v.local_blocks, v.remote_blocks, {ref} AS ref,
          (CASE s.grp WHEN 'p' THEN 0 WHEN 'd' THEN 1 ELSE 2 END::BIGINT << 58) + {ref} AS o,
          CASE WHEN v.kind = 'kv_load_failed' THEN 'P failed it on KV load failure (failure_policy=fail)'
               WHEN v.kind = 'request_failed' THEN 'vLLM: request failed (' || v.why || ')'
               WHEN v.kind = 'generated_response' AND v.finish_reason IN ('error', 'abort')
                 THEN 'finish_reason=' || v.finish_reason END AS fwhy
        FROM vl_slot s JOIN vl v USING (f, n)),
      {_one_or_grouped("a", "v", per_line, aggregated)},
      h AS (SELECT *, CASE WHEN last_wait IS NOT NULL AND NOT coalesce(completed, false)
                            AND NOT coalesce(last_recv > last_wait, false) THEN last_wait END AS p_hung FROM a)
      SELECT sid, p_first_ref, p_refs3, p_decl, coalesce(p_nixl_ctx, p_nixl_any) AS p_nixl,
        coalesce(p_nixl_ft_ctx, p_nixl_ft_any) AS p_nixl_ft, p_skip, p_skip_n, p_skip_thr, p_kvfail, p_read, p_start,
        p_start_local, p_start_remote, p_hung, released, stale_read, aborted,
        CASE WHEN {hung} THEN 'never completed: P stuck in WAITING_FOR_REMOTE_KVS (vLLM 0.33 recompute hang)'
             ELSE fail_why END AS vl_failed_why,
        CASE WHEN {hung} THEN p_hung ELSE fail_ref END AS vl_failed_ref
      FROM h"""
