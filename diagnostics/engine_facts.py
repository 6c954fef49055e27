"""What every turn's records say, one row per turn (``turn_facts``), in DuckDB: the inputs of the verdict rules.

Each column is one fact a rule reads (diagnostics/rules.py), taken from the records engine_join put in
the turn: the turn's numbers (client first: its events, then its statistics, then the router and P),
the deciding event of an instrumented turn, the proxy's lookup and lines, P's and D's lines for the
request, and whether and why the turn failed. A line a rule may cite is a *ref*, ``(f << 40) + n``; the
evidence's ``file:line`` and text are looked up only for the turns explain prints (``evidence_sql``).
"""

from __future__ import annotations

from typing import Final

from kvdiag.diagnostics.engine_parse import VLLM_TEXT, sql_str

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
CS_ORDER: Final = "((cs.f::HUGEINT << 96) + (cs.n::HUGEINT << 48) + cs.sub)"
# the client statistics' numbers a turn takes (from its last statistic), as s_<name>
_STAT_NUMBERS: Final = ("ttft_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
                        "output_num_tokens")


def _first(expr: str, order: str, where: str) -> str:
    return f"arg_min({expr}, {order}) FILTER (WHERE {where})"


# the event columns ev_facts and decider read (tev_r carries no others: it holds a row per turn event)
_TEV_COLUMNS: Final = tuple(dict.fromkeys(("f", "n", "ts", "status", "http_status", "outcome", "reason",
                                           "engine_request_id", "remote_read_tokens", "duration_ms",
                                           *EVENT_NUMBERS)))


def facts_sql() -> list[str]:
    """The statements that build ``turn_facts`` (after engine_join)."""
    cols = ", ".join(f"e.{c}" for c in _TEV_COLUMNS)
    return [
        # a turn's events in the order the rules read them: client, router, P (each in file order), D
        f"""CREATE TEMP TABLE tev_r AS
           SELECT {cols}, s.sid, CASE e.source WHEN 'client' THEN 0 ELSE 1 END AS grp,
             (CASE e.source WHEN 'client' THEN 0 ELSE 1 END::BIGINT << 58) + (coalesce(s.pass, 3)::BIGINT << 54)
               + {REF.replace('f', 'e.f').replace('+ n', '+ e.n')} AS o
           FROM ev_slot s JOIN ev e USING (f, n)
           UNION ALL SELECT {cols}, s.sid, CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END,
             (CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END::BIGINT << 58) + {REF.replace('f', 'e.f').replace(
                 '+ n', '+ e.n')}
           FROM eng_slot s JOIN ev e USING (f, n)""",
        # turns with more than one client or router event, or with engine events (few): aggregated; the others
        # pair their client and router event by a join (35 FILTERed aggregates per turn cost several seconds)
        """CREATE TEMP TABLE tev_multi AS SELECT sid FROM tev_r GROUP BY sid
           HAVING count(*) FILTER (WHERE grp = 0) > 1 OR count(*) FILTER (WHERE grp = 1) > 1
             OR count(*) FILTER (WHERE grp >= 2) > 0""",
        _ev_facts_sql(),
        f"""CREATE TEMP TABLE decider AS
           WITH pick AS (SELECT sid, eng_os, CASE
               WHEN r_first IS NOT NULL AND r_inferred AND p_known IS NOT NULL THEN p_known
               WHEN r_first IS NOT NULL AND r_outcome <> 'unknown' THEN r_first
               WHEN p_first IS NOT NULL AND p_first = p_known THEN p_first
               WHEN c_first IS NOT NULL THEN c_first END AS dec_o FROM ev_facts
             WHERE r_first IS NOT NULL OR p_first IS NOT NULL OR c_first IS NOT NULL)
           SELECT p.sid, t.outcome AS dec_verdict, t.reason AS dec_reason, t.failure_type AS dec_ft,
             starts_with(coalesce(t.reason, ''), 'inferred') AS dec_inferred,
             {REF.replace('f', 't.f').replace('+ n', '+ t.n')} AS dec_ref,
             list_transform(list_filter(p.eng_os, lambda x: x <> p.dec_o)[1:3],
                            lambda x: x & ((1::BIGINT << 54) - 1)) AS eng_refs
           FROM pick p JOIN tev_r t ON t.sid = p.sid AND t.o = p.dec_o
           WHERE t.outcome IS NOT NULL AND t.outcome <> 'unknown'""",
        # ---- the proxy's request (engine_join folds its lines into px_slot; a line's place is its ref): the last
        # line is the last of its own lines, its stored handle and a "not caching" line naming no request
        """CREATE TEMP VIEW px_facts AS
            SELECT p.sid, p.rid AS px_rid, p.seq AS px_seq, p.lookup AS px_lookup, p.stored_seq,
              p.head_age AS px_age, p.head_ttl AS px_ttl, p.first_ref AS px_first,
              greatest(p.last_seq, p.stored_seq, CASE WHEN nc.by_conv THEN nc.seq END) AS px_last,
              (greatest(p.last_seq, p.stored_seq, CASE WHEN nc.by_conv THEN nc.seq END) >> 40)::INTEGER AS px_last_f,
              p.first_ts AS px_first_ts, p.sending AS px_sending, p.miss AS px_miss, p.prefill_ms AS px_prefill_ms,
              p.done AS px_done, p.failed_why AS px_failed_why, p.failed_ref AS px_failed_ref,
              p.withheld AS px_withheld, p.withheld_why AS px_withheld_why, p.stored_seq AS px_stored,
              nc.seq AS px_not_stored, nc.why AS px_not_stored_why, p.offered AS px_offered
            FROM px_slot p
            LEFT JOIN px_not_cached nc ON nc.rid = p.rid""",
        # ---- P's, D's and other engines' lines of the request
        f"""CREATE TEMP TABLE vl_in AS SELECT s.sid, s.grp, v.f, v.n, v.kind, v.ctx_request_id, v.failure_type,
              v.remote_tokens, v.threshold, v.local_blocks, v.remote_blocks, v.why, v.finish_reason,
              (CASE s.grp WHEN 'p' THEN 0 WHEN 'd' THEN 1 ELSE 2 END::BIGINT << 58) + {REF.replace(
                  'f', 'v.f').replace('+ n', '+ v.n')} AS o
            FROM vl_slot s JOIN vl v USING (f, n)""",
        f"""CREATE TEMP TABLE vl_facts AS
            WITH w AS (SELECT sid, max(o) FILTER (WHERE grp = 'p' AND kind = 'waiting_remote_kvs') AS last_wait,
                         bool_or(grp = 'p' AND kind IN ({", ".join(map(sql_str, _COMPLETED_KINDS))})) AS completed,
                         max(o) FILTER (WHERE grp = 'p' AND kind = 'finished_recving') AS last_recv
                       FROM vl_in GROUP BY sid),
            hung AS (SELECT sid, last_wait FROM w WHERE last_wait IS NOT NULL AND NOT coalesce(completed, false)
                       AND NOT coalesce(last_recv > last_wait, false)),
            fl AS (SELECT v.*, CASE WHEN v.kind = 'kv_load_failed' THEN 'P failed it on KV load failure '
                                         || '(failure_policy=fail)'
                                    WHEN v.kind = 'request_failed' THEN 'vLLM: request failed (' || v.why || ')'
                                    WHEN v.kind = 'generated_response' AND v.finish_reason IN ('error', 'abort')
                                      THEN 'finish_reason=' || v.finish_reason
                                    WHEN v.o = h.last_wait THEN 'never completed: P stuck in WAITING_FOR_REMOTE_KVS '
                                         || '(vLLM 0.33 recompute hang)' END AS fwhy
                   FROM vl_in v LEFT JOIN hung h ON h.sid = v.sid)
            SELECT sid,
              {_first(REF, 'o', "grp = 'p'")} AS p_first_ref,
              (list({REF} ORDER BY o) FILTER (WHERE grp = 'p'))[1:3] AS p_refs3,
              {_first(REF, 'o', "grp = 'p' AND kind = 'declining_expired'")} AS p_decl,
              coalesce({_first(REF, 'o', "grp = 'p' AND kind = 'nixl_failure' AND ctx_request_id IS NOT NULL")},
                       {_first(REF, 'o', "grp = 'p' AND kind = 'nixl_failure'")}) AS p_nixl,
              coalesce({_first('failure_type', 'o',
                               "grp = 'p' AND kind = 'nixl_failure' AND ctx_request_id IS NOT NULL")},
                       {_first('failure_type', 'o', "grp = 'p' AND kind = 'nixl_failure'")}) AS p_nixl_ft,
              {_first(REF, 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip,
              {_first('remote_tokens', 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip_n,
              {_first('threshold', 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip_thr,
              {_first(REF, 'o', "grp = 'p' AND kind = 'kv_load_failed'")} AS p_kvfail,
              {_first(REF, 'o', "grp = 'p' AND kind IN ('read_blocks', 'finished_recving')")} AS p_read,
              {_first(REF, 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start,
              {_first('local_blocks', 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start_local,
              {_first('remote_blocks', 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start_remote,
              {_first(REF, 'o', "fwhy LIKE 'never completed%'")} AS p_hung,
              {_first(REF, 'o', "grp = 'released'")} AS released,
              {_first(REF, 'o', "grp = 'stale'")} AS stale_read,
              {_first(REF, "(CASE grp WHEN 'd' THEN 0 WHEN 'p' THEN 1 ELSE 2 END::BIGINT << 58) + (o & ((1::BIGINT "
                           "<< 58) - 1))", "grp IN ('p', 'd', 'o') AND kind = 'aborted'")} AS aborted,
              {_first('fwhy', 'o', "grp IN ('p', 'd', 'o') AND fwhy IS NOT NULL")} AS vl_failed_why,
              {_first(REF, 'o', "grp IN ('p', 'd', 'o') AND fwhy IS NOT NULL")} AS vl_failed_ref
            FROM fl GROUP BY sid""",
        # ---- one row per turn
        f"""CREATE TEMP VIEW turn_facts AS
           SELECT s.sid, s.conv AS conversation_id, s.turn, s.rid AS request_id,
             e.* EXCLUDE (sid), d.* EXCLUDE (sid), p.* EXCLUDE (sid), v.* EXCLUDE (sid),
             {", ".join(f"c.{c} AS s_{c}" for c in _STAT_NUMBERS)}, c.ref AS stat_ref, c.ref IS NOT NULL AS has_stat
           FROM slots s LEFT JOIN ev_facts e USING (sid) LEFT JOIN decider d USING (sid)
           LEFT JOIN px_facts p USING (sid) LEFT JOIN vl_facts v USING (sid)
           LEFT JOIN (SELECT cs_slot.sid, {", ".join(f"arg_max(cs.{c}, {CS_ORDER}) AS {c}" for c in _STAT_NUMBERS)},
                        max((cs.f::BIGINT << 40) + cs.n) AS ref
                      FROM cs_slot JOIN cs USING (f, n, sub) GROUP BY cs_slot.sid) c USING (sid)""",
    ]


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


def _ev_facts_sql() -> str:
    """``ev_facts``: aggregated over the events of the turns in ``tev_multi``; for every other turn (at most one
    client and one router event) the client's row joined to the router's, which gives the same values: the
    client's event comes first in ``o``, and arg_min/arg_max skip NULL values as the CASE below does."""
    specs = _ev_fact_specs()
    agg = {"first": "arg_min({v}, o) FILTER (WHERE {w})", "last": "arg_max({v}, o) FILTER (WHERE {w})",
           "any": "bool_or({w})"}
    aggregated = ",\n  ".join(agg[how].format(v=v, w=w) + f" AS {c}" for c, how, v, w in specs)
    per_row = ", ".join(f"{w} AS {c}" if how == "any" else f"CASE WHEN {w} THEN {v} END AS {c}"
                        for c, how, v, w in specs)
    pair = {"first": "coalesce(c.{c}, r.{c})", "last": "coalesce(r.{c}, c.{c})",
            # bool_or: NULL when no row says true or false
            "any": "CASE WHEN c.{c} IS NOT NULL OR r.{c} IS NOT NULL THEN coalesce(c.{c}, false) "
                   "OR coalesce(r.{c}, false) END"}
    paired = ",\n  ".join(pair[how].format(c=c) + f" AS {c}" for c, how, _v, _w in specs)
    return f"""CREATE TEMP TABLE ev_facts AS
      WITH c AS (SELECT sid, {per_row} FROM tev_r WHERE grp = 0 AND sid NOT IN (SELECT sid FROM tev_multi)),
      r AS (SELECT sid, {per_row} FROM tev_r WHERE grp = 1 AND sid NOT IN (SELECT sid FROM tev_multi))
      SELECT coalesce(c.sid, r.sid) AS sid, true AS has_events, {paired}, NULL::BIGINT[] AS eng_os
      FROM c FULL JOIN r ON c.sid = r.sid
      UNION ALL SELECT sid, count(*) FILTER (WHERE grp IN (0, 1)) > 0 AS has_events, {aggregated},
        (list(o ORDER BY o) FILTER (WHERE grp >= 2))[1:4] AS eng_os
      FROM tev_r WHERE sid IN (SELECT sid FROM tev_multi) GROUP BY sid"""


_WS: Final = "' \t\r\n\x0b\x0c'"


def evidence_sql(refs: str) -> str:
    """SELECT (ref, source, text) for the refs in table ``refs`` (column ``ref``): each record's ``file:line``
    and its text (at most 300 characters), as explain prints them."""
    return f"""
WITH r AS (SELECT DISTINCT ref, (ref >> 40)::INTEGER AS f, (ref & ((1::BIGINT << 40) - 1)) AS n FROM {refs}),
t AS (SELECT r.ref, r.f, r.n, coalesce(e.text, c.text, CASE WHEN h.f IS NOT NULL THEN {VLLM_TEXT} END,
      CASE WHEN lj.line IS NOT NULL THEN left(CASE
        WHEN starts_with(lj.line, '{{') AND ends_with(lj.line, '}}') THEN lj.line ELSE trim(lj.line, {_WS}) END, 500)
        END, left(CASE WHEN ends_with(lp.line, chr(13)) THEN rtrim(lp.line, chr(13)) ELSE lp.line END, 500)) AS text
      FROM r LEFT JOIN ev e ON e.f = r.f AND e.n = r.n
      LEFT JOIN (SELECT f, n, arg_max(text, sub) AS text FROM cs GROUP BY f, n) c ON c.f = r.f AND c.n = r.n
      LEFT JOIN vl_head h ON h.f = r.f AND h.n = r.n LEFT JOIN lines_json lj ON lj.f = r.f AND lj.n = r.n
      LEFT JOIN lines_proxy lp ON lp.f = r.f AND lp.n = r.n)
SELECT t.ref, fl.path || ':' || t.n AS source, left(t.text, 300) AS text FROM t JOIN files fl USING (f)
WHERE t.text IS NOT NULL"""
