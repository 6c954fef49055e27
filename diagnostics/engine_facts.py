"""What every turn's records say, one row per turn (``facts``), in DuckDB: the inputs of the verdict rules.

Each column is one fact a rule reads (diagnostics/rules.py), taken from the records engine_join put in
the turn: the turn's numbers (client first: its events, then its statistics, then the router and P),
the deciding event of an instrumented turn, the proxy's lookup and lines, P's and D's lines for the
request, whether and why the turn failed, and the previous turn's facts. A line a rule may cite is a
``ref``: ``{source: 'file:line', text}`` (the evidence explain prints).
"""

from __future__ import annotations

from typing import Final

from kvdiag.diagnostics.engine_parse import sql_str

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


def _ref(alias: str) -> str:
    return f"CASE WHEN {alias}.src IS NOT NULL THEN {{'source': {alias}.src, 'text': left({alias}.text, 300)}} END"


def _first(expr: str, order: str, where: str) -> str:
    return f"arg_min({expr}, {order}) FILTER (WHERE {where})"


def facts_sql() -> list[str]:
    """The statements that build ``facts`` (after engine_join)."""
    failed = ", ".join(map(sql_str, FAILED_STATUSES))
    numbers = ",\n  ".join(f"{_first(c, 'o', f'{c} IS NOT NULL')} AS e_{c}" for c in EVENT_NUMBERS)
    return [
        # the records, each with the file:line it is cited by
        """CREATE TEMP TABLE ev_r AS SELECT e.*, fl.path || ':' || e.n AS src FROM evc e JOIN files fl USING (f)""",
        """CREATE TEMP TABLE vl_r AS SELECT v.*, fl.path || ':' || v.n AS src, fr.role FROM vl v JOIN files fl USING (f)
           JOIN froles fr USING (f)""",
        """CREATE TEMP TABLE pl_r AS SELECT p.*, fl.path || ':' || p.n AS src FROM plc p JOIN files fl USING (f)""",
        """CREATE TEMP TABLE cs_r AS SELECT c.*, fl.path || ':' || c.n AS src, s.sid FROM cs c JOIN files fl USING (f)
           JOIN cs_slot s USING (f, n)""",
        # a turn's events in the order the rules read them: client, router, P (each in file order), D
        """CREATE TEMP TABLE tev_r AS
           SELECT e.*, s.sid, CASE e.source WHEN 'client' THEN 0 WHEN 'router' THEN 1 END AS grp,
             (CASE e.source WHEN 'client' THEN 0 ELSE 1 END::BIGINT << 56) + (coalesce(t.pass, 3)::BIGINT << 52)
               + (e.f::BIGINT << 40) + e.n AS o
           FROM ev_slot s JOIN ev_r e USING (f, n) LEFT JOIN tev t USING (f, n)
           UNION ALL SELECT e.*, s.sid, CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END,
             (CASE s.source WHEN 'prefill' THEN 2 ELSE 3 END::BIGINT << 56) + (e.f::BIGINT << 40) + e.n
           FROM eng_slot s JOIN ev_r e USING (f, n)""",
        f"""CREATE TEMP TABLE ev_facts AS SELECT sid,
              count(*) FILTER (WHERE grp IN (0, 1)) > 0 AS has_events,
              bool_or(grp = 0 AND status = 'ok') AS client_ok,
              {_first(_ref('tev_r'), 'o', "grp = 0 AND status = 'ok'")} AS client_ok_ref,
              {_first('ts', 'o', 'grp < 3')} AS e_ts,
              {numbers},
              {_first('remote_read_tokens', 'o', 'grp < 3 AND remote_read_tokens IS NOT NULL')} AS e_remote_tokens,
              {_first('duration_ms', 'o', 'grp < 3 AND duration_ms IS NOT NULL')} AS e_latency_ms,
              {_first('ttft_ms', 'o', 'grp = 0 AND ttft_ms IS NOT NULL')} AS c_ttft_ms,
              {_first('prompt_tokens', 'o', 'grp = 0 AND prompt_tokens IS NOT NULL')} AS c_prompt_tokens,
              {_first('completion_tokens', 'o', 'grp = 0 AND completion_tokens IS NOT NULL')} AS c_completion_tokens,
              {_first('duration_ms', 'o', 'grp = 0 AND duration_ms IS NOT NULL')} AS c_latency_ms,
              arg_max(status, o) FILTER (WHERE grp = 0 AND status IS NOT NULL) AS c_status,
              arg_max(status, o) FILTER (WHERE grp < 3 AND status IS NOT NULL AND status <> 'ok') AS bad_status,
              {_first('status', 'o', 'grp < 3 AND status IS NOT NULL')} AS first_status,
              arg_max(engine_request_id, o) FILTER (WHERE grp = 2 AND engine_request_id <> '') AS prefill_request_id,
              arg_max(engine_request_id, o) FILTER (WHERE grp = 3 AND engine_request_id <> '') AS decode_request_id,
              {_first("'status=' || status || CASE WHEN coalesce(http_status, 0) <> 0 THEN ', HTTP ' || http_status "
                      "ELSE '' END", 'o', f'grp IN (0, 1) AND status IN ({failed})')} AS ev_failed_why,
              {_first(_ref('tev_r'), 'o', f'grp IN (0, 1) AND status IN ({failed})')} AS ev_failed_ref,
              -- the deciding event (classify's instrumented order): the router's first outcome, unless only
              -- inferred while P states one; then P's; then the client's
              {_first('o', 'o', 'grp = 1 AND outcome IS NOT NULL')} AS r_first,
              {_first('o', 'o', f'grp = 2 AND {_KNOWN}')} AS p_known,
              {_first('o', 'o', 'grp = 2 AND outcome IS NOT NULL')} AS p_first,
              {_first('o', 'o', 'grp = 0 AND outcome IS NOT NULL')} AS c_first,
              {_first('remote_request_id', 'o', 'grp = 1 AND remote_request_id IS NOT NULL')} AS r_offered
            FROM tev_r GROUP BY sid""",
        """CREATE TEMP TABLE decider AS
           WITH r AS (SELECT f.sid, f.p_known, f.p_first, f.c_first, t.outcome AS r_outcome,
                        starts_with(coalesce(t.reason, ''), 'inferred') AS r_inferred, f.r_first
                      FROM ev_facts f LEFT JOIN tev_r t ON t.sid = f.sid AND t.o = f.r_first),
           pick AS (SELECT sid, CASE
               WHEN r_first IS NOT NULL AND r_inferred AND p_known IS NOT NULL THEN p_known
               WHEN r_first IS NOT NULL AND r_outcome <> 'unknown' THEN r_first
               WHEN p_first IS NOT NULL AND p_first = p_known THEN p_first
               WHEN c_first IS NOT NULL THEN c_first END AS dec_o FROM r)
           SELECT p.sid, t.outcome AS dec_verdict, t.reason AS dec_reason, t.failure_type AS dec_ft,
             starts_with(coalesce(t.reason, ''), 'inferred') AS dec_inferred, {'source': t.src, 'text':
             left(t.text, 300)} AS dec_ref,
             (SELECT list({'source': x.src, 'text': left(x.text, 300)} ORDER BY x.o) FROM tev_r x
              WHERE x.sid = p.sid AND x.grp >= 2 AND x.o <> p.dec_o) AS eng_refs
           FROM pick p JOIN tev_r t ON t.sid = p.sid AND t.o = p.dec_o
           WHERE t.outcome IS NOT NULL AND t.outcome <> 'unknown'""",
        # ---- the proxy's request: its lines in order (the HIT/stale/history line it took first)
        """CREATE TEMP TABLE px_lines AS
           SELECT p.sid, 0 AS lo, l.* FROM px_slot p JOIN pl_r l ON l.f = p.head_f AND l.n = p.head_n
           UNION ALL SELECT p.sid, l.seq, l.* FROM px_slot p JOIN pl_r l ON l.rid = p.rid
             AND l.kind NOT IN ('cached', 'ready') AND l.seq >= p.seq
           UNION ALL SELECT p.sid, l.seq, l.* FROM px_slot p JOIN pl_r l ON l.kind = 'cached' AND hrid(l.remote) = p.rid
             AND l.seq > p.seq
           UNION ALL SELECT p.sid, l.seq, l.* FROM px_slot p JOIN px_not_cached nc ON nc.rid = p.rid
             JOIN pl_r l ON l.f = nc.f AND l.n = nc.n AND l.rid IS NULL""",
        f"""CREATE TEMP TABLE px_agg AS SELECT sid,
              arg_min({_ref('o')}, lo) AS px_first, arg_max({_ref('o')}, lo) AS px_last, arg_max(f, lo) AS px_last_f,
              arg_min(ts, lo) AS px_first_ts,
              {_first(_ref('o'), 'lo', "kind = 'sending'")} AS px_sending,
              {_first(_ref('o'), 'lo', "kind IN ('miss', 'no_handle')")} AS px_miss,
              {_first('TRY_CAST(ms AS DOUBLE)', 'lo', "kind = 'prefill_done'")} AS px_prefill_ms,
              bool_or(kind = 'prefill_done') AS px_done,
              {_first("left(replace(kind, '_', ' ') || ': ' || coalesce(detail, ''), 200)", 'lo',
                      "kind IN ('prefill_failed', 'decode_failed')")} AS px_failed_why,
              {_first(_ref('o'), 'lo', "kind IN ('prefill_failed', 'decode_failed')")} AS px_failed_ref
            FROM px_lines o GROUP BY sid""",
        f"""CREATE TEMP TABLE px_facts AS
            SELECT p.sid, p.rid AS px_rid, p.seq AS px_seq, p.lookup AS px_lookup, p.stored_seq,
              p.head_age AS px_age, p.head_ttl AS px_ttl, a.* EXCLUDE (sid),
              CASE p.withheld WHEN 'head' THEN {_ref('hl')} WHEN 'line' THEN {_ref('dl')} END AS px_withheld,
              CASE p.withheld WHEN 'head' THEN hl.why WHEN 'line' THEN dl.why END AS px_withheld_why,
              {_ref('sl')} AS px_stored, sl.src IS NOT NULL AS px_has_stored,
              {_ref('nl')} AS px_not_stored, nl.src IS NOT NULL AS px_has_not_stored, nc.why AS px_not_stored_why,
              p.offered AS px_offered
            FROM px_slot p JOIN px_agg a USING (sid)
            LEFT JOIN pl_r hl ON hl.f = p.head_f AND hl.n = p.head_n
            LEFT JOIN pl_r dl ON dl.f = p.def_f AND dl.n = p.def_n
            LEFT JOIN pl_r sl ON sl.f = p.stored_f AND sl.n = p.stored_n
            LEFT JOIN px_not_cached nc ON nc.rid = p.rid
            LEFT JOIN pl_r nl ON nl.f = nc.f AND nl.n = nc.n""",
        # ---- P's, D's and other engines' lines of the request
        """CREATE TEMP TABLE vl_in AS SELECT s.sid, s.grp, v.*, (CASE s.grp WHEN 'p' THEN 0 WHEN 'd' THEN 1 ELSE 2 END
             ::BIGINT << 56) + (v.f::BIGINT << 40) + v.n AS o FROM vl_slot s JOIN vl_r v USING (f, n)""",
        f"""CREATE TEMP TABLE vl_facts AS
            WITH w AS (SELECT sid, max(o) FILTER (WHERE grp = 'p' AND kind = 'waiting_remote_kvs') AS last_wait,
                         bool_or(grp = 'p' AND kind IN ({", ".join(map(sql_str, _COMPLETED_KINDS))})) AS completed
                       FROM vl_in GROUP BY sid),
            hung AS (SELECT w.sid, w.last_wait FROM w WHERE w.last_wait IS NOT NULL AND NOT coalesce(w.completed, false)
                       AND NOT EXISTS (SELECT 1 FROM vl_in v WHERE v.sid = w.sid AND v.grp = 'p'
                                       AND v.kind = 'finished_recving' AND v.o > w.last_wait)),
            fl AS (SELECT v.*, CASE WHEN v.kind = 'kv_load_failed' THEN 'P failed it on KV load failure '
                                         || '(failure_policy=fail)'
                                    WHEN v.kind = 'request_failed' THEN 'vLLM: request failed (' || v.why || ')'
                                    WHEN v.kind = 'generated_response' AND v.finish_reason IN ('error', 'abort')
                                      THEN 'finish_reason=' || v.finish_reason
                                    WHEN v.o = h.last_wait THEN 'never completed: P stuck in WAITING_FOR_REMOTE_KVS '
                                         || '(vLLM 0.33 recompute hang)' END AS fwhy
                   FROM vl_in v LEFT JOIN hung h ON h.sid = v.sid)
            SELECT sid,
              {_first(_ref('fl'), 'o', "grp = 'p'")} AS p_first_ref,
              (list({_ref('fl')} ORDER BY o) FILTER (WHERE grp = 'p'))[1:3] AS p_refs3,
              {_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'declining_expired'")} AS p_decl,
              coalesce({_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'nixl_failure' AND ctx_request_id IS NOT NULL")},
                       {_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'nixl_failure'")}) AS p_nixl,
              coalesce({_first('failure_type', 'o',
                               "grp = 'p' AND kind = 'nixl_failure' AND ctx_request_id IS NOT NULL")},
                       {_first('failure_type', 'o', "grp = 'p' AND kind = 'nixl_failure'")}) AS p_nixl_ft,
              {_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip,
              {_first('remote_tokens', 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip_n,
              {_first('threshold', 'o', "grp = 'p' AND kind = 'skip_remote_pull'")} AS p_skip_thr,
              {_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'kv_load_failed'")} AS p_kvfail,
              {_first(_ref('fl'), 'o', "grp = 'p' AND kind IN ('read_blocks', 'finished_recving')")} AS p_read,
              {_first(_ref('fl'), 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start,
              {_first('local_blocks', 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start_local,
              {_first('remote_blocks', 'o', "grp = 'p' AND kind = 'start_load_kv'")} AS p_start_remote,
              {_first(_ref('fl'), 'o', "fwhy IS NOT NULL AND fwhy LIKE 'never completed%'")} AS p_hung,
              {_first(_ref('fl'), 'o', "grp = 'released'")} AS released,
              {_first(_ref('fl'), 'o', "grp = 'stale'")} AS stale_read,
              {_first(_ref('fl'), "(CASE grp WHEN 'd' THEN 0 WHEN 'p' THEN 1 ELSE 2 END::BIGINT << 56) "
                                  "+ (f::BIGINT << 40) + n",
                      "grp IN ('p', 'd', 'o') AND kind = 'aborted'")} AS aborted,
              {_first('fwhy', 'o', "grp IN ('p', 'd', 'o') AND fwhy IS NOT NULL")} AS vl_failed_why,
              {_first(_ref('fl'), 'o', "grp IN ('p', 'd', 'o') AND fwhy IS NOT NULL")} AS vl_failed_ref
            FROM fl GROUP BY sid""",
        # ---- one row per turn
        """CREATE TEMP TABLE turn_facts AS
           SELECT s.sid, s.conv AS conversation_id, s.turn, s.rid AS request_id,
             e.*, d.dec_verdict, d.dec_reason, d.dec_ft, d.dec_inferred, d.dec_ref, d.eng_refs,
             p.*, v.*,
             c.ttft_ms AS s_ttft_ms, c.latency_ms AS s_latency_ms, c.start_time_ms AS s_start_time_ms,
             c.input_num_turns AS s_input_num_turns, c.input_num_tokens AS s_input_num_tokens,
             c.output_num_tokens AS s_output_num_tokens,
             CASE WHEN c.src IS NOT NULL THEN {'source': c.src, 'text': left(c.text, 300)} END AS stat_ref,
             c.src IS NOT NULL AS has_stat
           FROM slots s LEFT JOIN ev_facts e USING (sid) LEFT JOIN decider d USING (sid)
           LEFT JOIN px_facts p USING (sid)
           LEFT JOIN vl_facts v USING (sid)
           LEFT JOIN (SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY sid ORDER BY f DESC, n DESC) AS k
                                     FROM cs_r) WHERE k = 1) c USING (sid)""",
    ]
