"""The records of one turn joined by ids, in DuckDB: the verdict engine's correlator.

conversation_id → router X-Request-Id (proxy ``[rid]``, events ``request_id``) → engine external id
``chatcmpl-<rid>`` → internal ``chatcmpl-<rid>-<8>`` → D's internal id is the ``remote_request_id``
handed to P next turn. Hashed conversation ids (router ``--hash-ids``: sha256 hex prefixes) join too.
vLLM timestamps are never used to join.

Each turn is a *slot* (``slots``: ``sid``, conversation, turn, request id); every record that belongs to a
turn gets its slot: ``ev_slot``, ``px_req`` (the proxy's requests), ``cs_slot``, ``vl_slot``. The order
a slot is made in (``sid``) breaks ties as the conversation's turns are ordered. How records find their
turn, in this order:

1. turn events (router, then client) by request id, else by conversation and turn; a client event whose
   request id no router event has joins the one turn of its conversation and number that has only a
   router event (a failed request's client record may carry another id);
2. the proxy's requests by request id, else in order per conversation (the k-th request is turn k,
   unless an event already holds that turn number: then after the last turn);
3. client statistics by request id, else the k-th record of a conversation (by messages sent, then start
   time) is its k-th turn (after the turns the benchmark's ``--warmup-step`` left unmeasured), else a turn
   of their own by their number;
4. engine events and vLLM lines by the request ids they name (D's release lines by the handle offered).
"""

from __future__ import annotations

from typing import Final

from kvdiag.diagnostics.conversation_ids import HASH_PREFIX_LENGTHS
from kvdiag.diagnostics.engine_no_events import EventsOnly
from kvdiag.diagnostics.engine_parse import EVENT_ORDER, EVENT_ORDER_BASE, sql_str
from kvdiag.diagnostics.engine_proxy import line_order

# vLLM kinds only a prefill (reader) engine logs: they tell a file's role when its name does not.
PREFILL_KINDS: Final = ("declining_expired", "skip_remote_pull")


class FewRowsOnly(str):
    """A statement only a run over a few rows (one conversation's) makes."""

    __slots__ = ()


class BulkOnly(str):
    """A statement a run over a few rows leaves out (a FewRowsOnly one stands for it)."""

    __slots__ = ()


# schema.request_ids.header_request_id: drop a "-<8 alphanumerics>" suffix, then a chatcmpl-/cmpl- prefix. Two
# spellings of one function: over every line, one cut of the id itself (where its header id ends, ``ext_end``,
# and starts, ``hrid_start``; DuckDB computes their repeated parts once per row, and cuts a stored ASCII column
# by byte position, where it would count a computed string's characters from its start); for a few rows binding
# that costs more than running it, and the regular expressions are the cheaper.
MACROS: Final = (
    BulkOnly("""CREATE OR REPLACE TEMP MACRO ext_end(x) AS CASE WHEN length(x) > 9
         AND substr(x, length(x) - 8, 1) = '-' AND regexp_full_match(right(x, 8), '[0-9a-zA-Z]{8}')
         THEN length(x) - 9 ELSE length(x) END"""),
    BulkOnly("""CREATE OR REPLACE TEMP MACRO hrid_start(x) AS CASE WHEN ext_end(x) >= 9 AND starts_with(x, 'chatcmpl-')
         THEN 10 WHEN ext_end(x) >= 5 AND starts_with(x, 'cmpl-') THEN 6 ELSE 1 END"""),
    BulkOnly("CREATE OR REPLACE TEMP MACRO hrid(x) AS substr(x, hrid_start(x), ext_end(x) - hrid_start(x) + 1)"),
    FewRowsOnly(r"""CREATE OR REPLACE TEMP MACRO hrid(x) AS regexp_replace(regexp_replace(x,
         '(?s)^(.+)-[0-9a-zA-Z]{8}$', '\1'), '^(?:chatcmpl-|cmpl-)', '')"""),
)


# a turn event's (pass, file, line) as one number, and a slot's: its first event's
_POS: Final = "(pass::BIGINT << 61) + (f::BIGINT << 40) + n"
_FIRST_POS: Final = EVENT_ORDER_BASE.format(x="min(pord)")
_TAG_RE: Final = "|".join(f"[0-9a-f]{{{n}}}" for n in HASH_PREFIX_LENGTHS)


def join_sql(only: str | None, *, merged: bool = False) -> list[str]:
    """The statements that build the slots and every record's slot (``only``: one conversation's turns;
    ``merged``: several proxy logs, their lines ordered by ``po``)."""
    only_sql = "true" if only is None else f"cconv = {sql_str(only)}"
    lengths = " UNION ALL ".join(f"SELECT {n} AS len" for n in HASH_PREFIX_LENGTHS)
    # (a conversation's requests in time: with several proxy logs, px_order's order within a shared stamp)
    keys, request_order = (", gpo, inner_key", "gpo, inner_key") if merged else ("", "po")
    return [
        *MACROS,
        # roles: a vLLM file's name, else P's own lines
        f"""CREATE TEMP TABLE froles AS SELECT fl.f, fl.path, fl.fmt, coalesce(fl.role, CASE WHEN fl.fmt = 'vllm' AND
              EXISTS (SELECT 1 FROM vl WHERE vl.f = fl.f AND vl.kind IN ({", ".join(map(sql_str, PREFILL_KINDS))}))
              THEN 'prefill' END) AS role FROM files fl""",
        # hashed tags of the conversation ids events and statistics name (only where some logged id looks like one)
        f"""CREATE TEMP TABLE known_ids AS SELECT DISTINCT conversation_id AS id FROM (
              SELECT conversation_id FROM ev WHERE conversation_id IS NOT NULL
              UNION ALL SELECT conversation_id FROM cs WHERE conversation_id IS NOT NULL
              {"" if only is None else f"UNION ALL SELECT {sql_str(only)}"})""",
        f"""CREATE TEMP TABLE tag_map AS
            WITH logged AS (SELECT DISTINCT conversation_id AS tag FROM ev WHERE regexp_full_match(conversation_id,
                              '{_TAG_RE}')
                            UNION SELECT DISTINCT conv FROM pl WHERE regexp_full_match(conv, '{_TAG_RE}'))
            SELECT tag, min(id) AS conv FROM (
              SELECT k.id, left(sha256(k.id), l.len) AS tag FROM known_ids k, ({lengths}) l
              WHERE EXISTS (SELECT 1 FROM logged)) t
            WHERE tag IN (SELECT tag FROM logged) AND tag <> id GROUP BY tag""",
        "UPDATE ev_t SET cconv = m.conv FROM tag_map m WHERE ev_t.conversation_id = m.tag",
        "UPDATE pl SET cconv = m.conv FROM tag_map m WHERE pl.conv = m.tag",
        # (a few rows: ev written as a table once its conversations are settled; its readers then bind no view, 15
        # ms in all. Over every line the view costs nothing and the table a copy of every event)
        FewRowsOnly("CREATE TEMP TABLE ev_rows AS SELECT * FROM ev; DROP VIEW ev; ALTER TABLE ev_rows RENAME TO ev"),
        # ---- 1. turn events: router (pass 0), client events their router names (1), other client events (2);
        # an event's key is (f, n, sub): sub tells apart the events of a line json_logs read as a JSON array. pord
        # orders them by (pass, file, line, sub) as one number, for up to 2M files of 2^40 lines (only its order
        # is read: a row_number() over every event would sort them all)
        EventsOnly(f"""CREATE TEMP TABLE tev AS SELECT *, {EVENT_ORDER.format(order=_POS, sub="sub")}
              AS pord FROM (
              SELECT f, n, sub, request_id, cconv, turn, ts, CASE WHEN source = 'router' THEN 0
                WHEN request_id IN (SELECT request_id FROM ev WHERE source = 'router' AND request_id IS NOT NULL)
                THEN 1 ELSE 2 END AS pass
              FROM ev WHERE source IN ('router', 'client') AND cconv IS NOT NULL AND turn IS NOT NULL
                AND {only_sql})"""),
        # slots made by events: one per request id (its first event's conversation and turn), one per
        # conversation and number for events without a request id. The ids router events have come first
        # (a client event that joins one comes later in pord); the other client events' ids are none of those.
        EventsOnly(f"""CREATE TEMP TABLE slot_src AS SELECT request_id AS rid, arg_min(cconv, pord) AS conv,
             arg_min(turn, pord) AS turn, {_FIRST_POS} AS ord, 0 AS stage, bool_or(pass = 0) AS routed,
             bool_or(pass = 1) AS answered FROM tev WHERE pass < 2 AND request_id IS NOT NULL GROUP BY request_id"""),
        # a router-only turn of a conversation and number takes the first other client event of it
        EventsOnly("""CREATE TEMP TABLE lone AS SELECT conv, turn, min(rid) AS rid FROM slot_src
           WHERE routed AND NOT answered
           GROUP BY conv, turn HAVING count(*) = 1"""),
        EventsOnly("""CREATE TEMP TABLE lone_taken AS SELECT t.f, t.n, t.sub, l.rid FROM (
             SELECT f, n, sub, cconv, turn, row_number() OVER (PARTITION BY cconv, turn ORDER BY pord) AS k FROM tev
             WHERE pass = 2) t JOIN lone l ON l.conv = t.cconv AND l.turn = t.turn WHERE t.k = 1"""),
        EventsOnly("""CREATE TEMP TABLE ev_slot_key AS SELECT t.f, t.n, t.sub, t.pord, t.pass, t.ts,
             CASE WHEN lt.rid IS NOT NULL THEN lt.rid ELSE t.request_id END AS rid, t.cconv, t.turn
           FROM tev t LEFT JOIN lone_taken lt ON lt.f = t.f AND lt.n = t.n AND lt.sub = t.sub"""),
        "ALTER TABLE slot_src DROP COLUMN routed",
        "ALTER TABLE slot_src DROP COLUMN answered",
        EventsOnly(f"""INSERT INTO slot_src SELECT rid, arg_min(cconv, pord), arg_min(turn, pord), {_FIRST_POS}, 0
           FROM ev_slot_key
           WHERE pass = 2 AND rid IS NOT NULL AND rid NOT IN (SELECT rid FROM slot_src) GROUP BY rid"""),
        EventsOnly(f"""INSERT INTO slot_src SELECT NULL, cconv, turn, {_FIRST_POS}, 0 FROM ev_slot_key
           WHERE rid IS NULL GROUP BY cconv, turn"""),
        # router events without a conversation or turn join by the request id
        EventsOnly("""CREATE TEMP TABLE ev_rid_only AS SELECT f, n, sub, request_id AS rid FROM ev
           WHERE source = 'router' AND (cconv IS NULL OR turn IS NULL) AND request_id IN
             (SELECT rid FROM slot_src WHERE rid IS NOT NULL)"""),
        # ---- 2. the proxy's requests
        *_proxy_requests_sql(only_sql, merged=merged),
        *([_REPLICAS_ORDER_SQL] if merged else []),
        # the k-th request of a conversation no event names is turn k, unless an event holds that number (only
        # those that clash are numbered after the last turn)
        f"""CREATE TEMP TABLE px_new AS
           WITH q AS (SELECT rid, conv, po{keys}, row_number() OVER (PARTITION BY conv ORDER BY {request_order}) AS k
                      FROM {"px_order" if merged else "px_req WHERE conv IS NOT NULL"}),
           taken AS (SELECT conv, turn FROM slot_src WHERE rid IS NOT NULL),
           pick AS (SELECT q.*, EXISTS (SELECT 1 FROM taken t WHERE t.conv = q.conv AND t.turn = q.k) AS clash FROM q
                    WHERE rid NOT IN (SELECT rid FROM slot_src WHERE rid IS NOT NULL))
           SELECT rid, conv, po, k AS turn FROM pick WHERE NOT clash
           UNION ALL SELECT rid, conv, po,
               greatest(coalesce((SELECT max(turn) FROM taken t WHERE t.conv = c.conv), 0),
                        coalesce((SELECT max(p2.k) FROM pick p2 WHERE p2.conv = c.conv AND NOT p2.clash), 0))
               + row_number() OVER (PARTITION BY conv ORDER BY {request_order})
           FROM pick c WHERE clash""",
        """INSERT INTO slot_src SELECT rid, conv, turn, 1e12 + po, 1 FROM px_new""",
        # ---- slots, numbered in the order they were made: the events' and requests' ones before the statistics
        # place theirs (which come after them), so that a placed turn carries its slot
        """CREATE TEMP TABLE slots AS SELECT row_number() OVER (ORDER BY stage, ord, conv, turn) AS sid,
             rid, conv, turn, stage, ord FROM slot_src""",
        # ---- 3. client statistics
        *_stats_sql(only),
        """INSERT INTO slots SELECT (SELECT coalesce(max(sid), 0) FROM slots)
             + row_number() OVER (ORDER BY ord, conv, turn), rid, conv, turn, stage, ord FROM cs_new""",
        """CREATE TEMP TABLE by_rid AS SELECT rid, sid FROM slots WHERE rid IS NOT NULL""",
        EventsOnly("""CREATE TEMP TABLE ev_slot AS
           SELECT k.f, k.n, k.sub, s.sid, k.pass FROM ev_slot_key k JOIN slots s ON s.rid = k.rid
           UNION ALL SELECT k.f, k.n, k.sub, s.sid, k.pass FROM ev_slot_key k JOIN slots s
             ON k.rid IS NULL AND s.rid IS NULL AND s.conv = k.cconv AND s.turn = k.turn AND s.sid IN
               (SELECT sid FROM slots WHERE rid IS NULL)
           UNION ALL SELECT r.f, r.n, r.sub, b.sid, NULL FROM ev_rid_only r JOIN by_rid b USING (rid)"""),
        # the proxy's requests with their slot, and what the turn's facts read of them (px_facts): the first
        # line is the head, else where the request starts (a view: writing the table cost more than its two readers'
        # joins)
        """CREATE TEMP VIEW px_slot AS
           SELECT b.sid, p.rid, p.offered, p.seq, p.po, p.lookup, p.stored_seq, p.stored_po, p.head_age, p.head_ttl,
             coalesce(p.head_seq, p.seq) AS first_ref, p.last_seq,
             CASE WHEN p.head_seq IS NOT NULL THEN p.head_ts ELSE p.first_ts END AS first_ts,
             p.sending, p.miss, p.prefill_ms, p.done, p.failed_why, p.failed_ref,
             CASE p.withheld WHEN 'head' THEN p.head_seq WHEN 'line' THEN p.def_seq END AS withheld,
             p.withheld_why
           FROM px_req p JOIN by_rid b USING (rid)
           WHERE p.conv IS NOT NULL""",
        # (the same-numbered turn only for the statistics neither a request id nor a placed turn took: a
        # subquery over every statistic costs as much as the joins)
        """CREATE TEMP TABLE cs_slot AS
           WITH a AS MATERIALIZED (SELECT a.f, a.n, a.sub, a.conversation_id, a.nturn, coalesce(b.sid, pl.sid) AS sid
             FROM cs_pick a LEFT JOIN by_rid b ON b.rid = a.rid_match
             LEFT JOIN placed pl ON pl.conv = a.conversation_id AND pl.k = a.place AND a.rid_match IS NULL)
           SELECT f, n, sub, sid FROM a WHERE sid IS NOT NULL
           UNION ALL SELECT f, n, sub, (SELECT min(s.sid) FROM slots s WHERE s.conv = a.conversation_id
             AND s.turn = a.nturn) FROM a WHERE sid IS NULL""",
        # ---- 4. engine events: by request id (header or engine id), else their conversation and turn
        # (joins, not scalar subqueries: those checked every id of by_rid for a second slot, even with no engine
        # events; an id an event names has one slot, or those subqueries failed)
        EventsOnly("""CREATE TEMP TABLE eng_ev AS SELECT e.f, e.n, e.sub, e.source,
              coalesce(b1.sid, b2.sid, b3.sid, b4.sid) AS sid,
              e.cconv, e.turn
            FROM ev e LEFT JOIN by_rid b1 ON b1.rid = e.request_id LEFT JOIN by_rid b2 ON b2.rid = hrid(e.request_id)
              LEFT JOIN by_rid b3 ON b3.rid = e.engine_request_id
              LEFT JOIN by_rid b4 ON b4.rid = hrid(e.engine_request_id)
            WHERE e.source IN ('prefill', 'decode')"""),
        EventsOnly(f"""CREATE TEMP TABLE eng_new AS SELECT DISTINCT cconv AS conv, turn FROM eng_ev
            WHERE sid IS NULL AND cconv IS NOT NULL AND turn IS NOT NULL AND {only_sql}
              AND NOT EXISTS (SELECT 1 FROM slots s WHERE s.rid IS NULL AND s.conv = eng_ev.cconv
                              AND s.turn = eng_ev.turn)"""),
        EventsOnly("""INSERT INTO slots (sid, rid, conv, turn) SELECT (SELECT coalesce(max(sid), 0) FROM slots)
             + row_number() OVER (ORDER BY conv, turn), NULL, conv, turn FROM eng_new"""),
        EventsOnly("""CREATE TEMP TABLE eng_slot AS SELECT e.f, e.n, e.sub, e.source, coalesce(e.sid, s.sid) AS sid
           FROM eng_ev e
           LEFT JOIN slots s ON e.sid IS NULL AND s.rid IS NULL AND s.conv = e.cconv AND s.turn = e.turn
           WHERE coalesce(e.sid, s.sid) IS NOT NULL"""),
        # ---- vLLM lines: D's release of the handle a turn was offered, else by the ids a line names
        f"""CREATE TEMP TABLE offered AS SELECT offered_id, max(sid) AS sid FROM (
             SELECT p.sid, p.offered AS offered_id FROM px_slot p WHERE p.offered IS NOT NULL
             UNION ALL SELECT es.sid, arg_min(e.remote_request_id, {EVENT_ORDER.format(order="e.n", sub="e.sub")})
               FROM ev_slot es JOIN ev e USING (f, n, sub)
               WHERE e.source = 'router' AND e.remote_request_id IS NOT NULL
                 AND es.sid NOT IN (SELECT sid FROM px_slot WHERE offered IS NOT NULL) GROUP BY es.sid)
           GROUP BY offered_id""",
        """CREATE TEMP TABLE vl_slot AS
           WITH rel AS (SELECT v.f, v.n, o.sid, CASE v.kind WHEN 'releasing_expired' THEN 'released' ELSE 'stale' END
                          AS grp FROM vl v JOIN froles fr USING (f) JOIN offered o ON o.offered_id = v.request_id
                        WHERE v.kind IN ('releasing_expired', 'invalid_unrecognized')
                          AND fr.role IS DISTINCT FROM 'prefill'),
           -- every id a line names, as its header id (a projection: DuckDB computes hrid's repeated parts once;
           -- one per branch, so the stored column's is cut as the ASCII text it is)
           rids AS (SELECT f, n, hrid(request_id) AS rid FROM vl WHERE kind IS NOT NULL AND request_id IS NOT NULL
                    UNION ALL SELECT f, n, hrid(rid) FROM (
                      SELECT f, n, unnest(list_concat(request_ids, [ctx_request_id])) AS rid FROM vl
                      WHERE kind IS NOT NULL AND (len(request_ids) > 0 OR ctx_request_id IS NOT NULL))
                    WHERE rid IS NOT NULL),
           named AS (SELECT DISTINCT r.f, r.n, b.sid FROM rids r JOIN by_rid b ON b.rid = r.rid
                     WHERE NOT EXISTS (SELECT 1 FROM rel WHERE rel.f = r.f AND rel.n = r.n))
           SELECT * FROM rel
           UNION ALL SELECT nm.f, nm.n, nm.sid, CASE fr.role WHEN 'prefill' THEN 'p' WHEN 'decode' THEN 'd' ELSE 'o' END
           FROM named nm JOIN froles fr USING (f) WHERE fr.role IS NOT NULL
           -- (a file of no known role tells P's lines by their kind or the handle they name: only its lines join
           -- their line's fields and slot)
           UNION ALL SELECT nm.f, nm.n, nm.sid, CASE
               WHEN v.kind IN ('declining_expired', 'skip_remote_pull')
                 OR (v.kind = 'nixl_failure' AND v.ctx_remote_request_id IS NOT NULL
                     AND hrid(v.ctx_remote_request_id) IS DISTINCT FROM s.rid) THEN 'p' ELSE 'o' END
           FROM named nm JOIN froles fr USING (f) JOIN vl v USING (f, n) JOIN slots s ON s.sid = nm.sid
           WHERE fr.role IS NULL""",
    ]


# Several proxy logs (a router's replicas) order a conversation's requests by the lines' stamps, which the reference
# proxy writes in whole seconds. The requests of one conversation whose first lines share a stamp in different logs
# are ordered, where that order agrees with each proxy log's own:
# - as P's log has them, where P logged each one's arrival in one file ("Received request" or "Added request":
#   vLLM's request log, --enable-log-requests);
# - else each after the request whose handle it was offered (a hit reads the KV its previous turn left on D);
# - else the merged lines' order stands.
# (gpo: the earliest place among the requests of that stamp; inner_key: the place within.)
_REPLICAS_ORDER_SQL: Final = """CREATE TEMP TABLE px_order AS
    WITH RECURSIVE q AS (SELECT rid, conv, po, seq >> 40 AS log, stamp, offered FROM px_req WHERE conv IS NOT NULL),
    -- (only a stamp that requests of one conversation share across logs needs more than the lines' order; the
    -- stamps numbered, so that the windows below partition by a number, not by two strings)
    multi AS (SELECT conv, stamp, row_number() OVER () AS gid FROM q GROUP BY conv, stamp HAVING min(log) < max(log)),
    t AS (SELECT q.*, multi.gid FROM q JOIN multi ON multi.conv = q.conv AND multi.stamp = q.stamp),
    recv AS (SELECT hrid(v.request_id) AS rid, min((v.f::BIGINT << 40) + v.n) AS ppos FROM vl v
             JOIN froles fr USING (f)
             WHERE fr.role = 'prefill' AND v.kind IN ('received_request', 'added_request') AND v.request_id IS NOT NULL
             GROUP BY 1),
    -- the request of the same stamp whose handle a request was offered, and the chains those links make (each
    -- request has one such link at most, so the chains from the unlinked ones end; a cycle is never reached)
    link AS (SELECT t.rid, p.rid AS prev FROM t JOIN t p ON p.gid = t.gid
             AND p.rid = hrid(t.offered) AND p.rid <> t.rid),
    depth AS (SELECT rid, 0 AS d FROM t WHERE rid NOT IN (SELECT rid FROM link)
              UNION ALL SELECT l.rid, depth.d + 1 FROM link l JOIN depth ON l.prev = depth.rid),
    g AS (SELECT t.*, r.ppos, (d.d::BIGINT << 40) + t.po AS ckey, min(t.po) OVER (PARTITION BY t.gid) AS gpo
          FROM t LEFT JOIN recv r ON r.rid = t.rid LEFT JOIN depth d ON d.rid = t.rid),
    gl AS (SELECT *, lag(ppos) OVER lw AS log_prev, lag(ckey) OVER lw AS log_prev_c FROM g
           WINDOW lw AS (PARTITION BY gid, log ORDER BY po)),
    h AS (SELECT *, bool_and(ppos IS NOT NULL AND (log_prev IS NULL OR log_prev < ppos)) OVER w
            AND min(ppos >> 40) OVER w = max(ppos >> 40) OVER w AS by_p,
            bool_and(ckey IS NOT NULL AND (log_prev_c IS NULL OR log_prev_c < ckey)) OVER w AS by_chain
          FROM gl WINDOW w AS (PARTITION BY gid))
    SELECT rid, conv, po, gpo, CASE WHEN by_p THEN ppos WHEN by_chain THEN ckey ELSE po END AS inner_key FROM h
    UNION ALL SELECT rid, conv, po, po, po FROM q ANTI JOIN multi ON multi.conv = q.conv AND multi.stamp = q.stamp"""


def _proxy_requests_sql(only_sql: str, *, merged: bool = False) -> list[str]:
    """``px_req``: one row per proxy request id: the lines correlate's proxy pass folds into it, and what the
    turn's facts read of them (a line's place ``seq`` is its ref; ``po`` its place in time, which orders a
    conversation's requests: with several proxy logs (``merged``) pl's own, else ``seq``). A request's lines, its
    lookup and its stored handle are in one log: its replica's."""
    po = line_order(merged)
    same_log = " AND d.seq >> 40 = nc.f" if merged else ""
    failed = "kind IN ('prefill_failed', 'decode_failed')"
    defining = "kind IN ('sending', 'miss', 'no_handle') AND cconv IS NOT NULL"
    # why the proxy withheld D's blocks: said on the history line before the request, else on its miss line
    by_head = "d.kind IN ('miss', 'no_handle') AND h.kind = 'miss_head' AND h.why IS NOT NULL"
    by_line = "d.kind = 'miss' AND d.why IS NOT NULL"
    # (merged: the stamp of the request's first line, its head's where it has one, which px_order reads)
    first_stamp = "arg_min(stamp, seq) AS first_stamp, " if merged else ""
    stamp = ", CASE WHEN h.kind IS NOT NULL THEN h.stamp ELSE r.first_stamp END AS stamp" if merged else ""
    return [
        # a request's defining line (sending / miss / no_handle) takes the HIT, stale or history line logged
        # just before it for its conversation (head_seq). (The window sorts the lines' places alone; the defining
        # lines' ids are joined back after: sorting them with the window cost more.)
        f"""CREATE TEMP TABLE px_def AS SELECT * FROM (
              SELECT p.seq, p.kind, p.cconv, p.rid, p.remote, p.why, w.head_seq FROM (
                SELECT seq, lag(seq) OVER (PARTITION BY cconv{', f' if merged else ''} ORDER BY seq) AS head_seq FROM pl
                WHERE kind IN ('hit', 'stale', 'miss_head', 'sending', 'miss', 'no_handle') AND cconv IS NOT NULL) w
              JOIN pl p USING (seq))
            WHERE {defining} AND rid IS NOT NULL""",
        # one pass over the lines naming each request's id (the first is where it starts, the last defining one
        # decides its lookup, as correlate overwrites it); the last "cached D blocks" line naming it as its
        # remote request (if after its start, it stored its handle); the defining line's head
        f"""CREATE TEMP TABLE px_req AS
            WITH r AS (SELECT rid, min(seq) AS seq, min({po}) AS po, max(seq) AS last_seq, arg_min(ts, seq) AS first_ts,
                         {first_stamp}max(seq) FILTER (WHERE {defining}) AS def_seq,
                         min(seq) FILTER (WHERE kind = 'sending') AS sending,
                         min(seq) FILTER (WHERE kind IN ('miss', 'no_handle')) AS miss,
                         arg_min(TRY_CAST(ms AS DOUBLE), seq) FILTER (WHERE kind = 'prefill_done') AS prefill_ms,
                         bool_or(kind = 'prefill_done') AS done,
                         arg_min(CASE WHEN {failed} THEN left(replace(kind, '_', ' ') || ': ' || coalesce(detail, ''),
                                 200) END, seq) FILTER (WHERE {failed}) AS failed_why,
                         min(seq) FILTER (WHERE {failed}) AS failed_ref,
                         bool_or(kind = 'no_conversation_id') AS no_conv
                       FROM pl WHERE rid IS NOT NULL AND kind NOT IN ('cached', 'ready') GROUP BY rid),
            cached AS (SELECT hrid(remote) AS rid, max(seq) AS seq, max({po}) AS po FROM pl WHERE kind = 'cached'
                       GROUP BY 1)
            SELECT r.rid, d.cconv AS conv, r.seq, r.po,
              CASE WHEN d.kind = 'sending' THEN 'hit'
                   WHEN d.kind IS NOT NULL AND h.kind = 'stale' THEN 'stale'
                   WHEN d.kind IS NOT NULL THEN d.kind
                   WHEN r.no_conv THEN 'no_conversation_id' END AS lookup,
              CASE WHEN d.kind = 'sending' THEN d.remote END AS offered,
              CASE WHEN h.kind IS NOT NULL THEN d.head_seq END AS head_seq, h.ts AS head_ts,
              CASE WHEN h.kind IN ('hit', 'stale') THEN h.age END AS head_age,
              CASE WHEN h.kind = 'stale' THEN h.ttl END AS head_ttl,
              r.def_seq,
              CASE WHEN {by_head} THEN 'head' WHEN {by_line} THEN 'line' END AS withheld,
              CASE WHEN {by_head} THEN h.why WHEN {by_line} THEN d.why END AS withheld_why,
              CASE WHEN c.seq > r.seq THEN c.seq END AS stored_seq, CASE WHEN c.seq > r.seq THEN c.po END AS stored_po,
              r.first_ts, r.last_seq, r.sending, r.miss, r.prefill_ms, r.done, r.failed_why, r.failed_ref{stamp}
            FROM r LEFT JOIN cached c ON c.rid = r.rid LEFT JOIN px_def d ON d.seq = r.def_seq
            LEFT JOIN pl h ON h.seq = d.head_seq AND h.kind IN ('hit', 'stale', 'miss_head')
            WHERE d.cconv IS NULL OR {only_sql.replace('cconv', 'd.cconv')}""",
        # "not caching D blocks": the request it names, else (by_conv) its conversation's latest request before it
        f"""CREATE TEMP TABLE px_not_cached AS
           WITH nc AS (SELECT * FROM pl WHERE kind = 'not_cached'),
           named AS (SELECT nc.f, nc.n, nc.seq, nc.why, nc.rid, false AS by_conv FROM nc
                     JOIN px_req pf ON pf.rid = nc.rid WHERE nc.seq > pf.seq),
           by_conv AS (SELECT nc.f, nc.n, nc.seq, nc.why, (SELECT arg_max(d.rid, d.seq) FROM px_def d
                         WHERE d.cconv = nc.cconv AND d.seq < nc.seq{same_log}) AS rid, true AS by_conv
                       FROM nc WHERE nc.rid IS NULL AND nc.cconv IS NOT NULL)
           SELECT rid, arg_max(f, seq) AS f, arg_max(n, seq) AS n, arg_max(why, seq) AS why, max(seq) AS seq,
             arg_max(by_conv, seq) AS by_conv
           FROM (SELECT * FROM named UNION ALL SELECT * FROM by_conv WHERE rid IS NOT NULL) GROUP BY rid""",
    ]


def _stats_sql(only: str | None) -> list[str]:
    """``cs_pick``: where each client statistic goes (a request id, the k-th placed turn, or its own number)."""
    only_sql = "true" if only is None else f"conversation_id = {sql_str(only)}"
    return [
        # the turns already made, in the order correlate's _request_order gives (turn, then the proxy's order
        # or the events' time); only conversations with statistics (the only ones placed). A request's own slot
        # (stage 1) holds its place in ord (px_new's 1e12 + seq): only the events' slots look theirs up
        """CREATE TEMP TABLE placed AS
           WITH s AS (SELECT * FROM slots WHERE conv IN (SELECT conversation_id FROM cs))
           SELECT s.conv, row_number() OVER (PARTITION BY s.conv ORDER BY s.turn,
             coalesce(CASE WHEN s.stage = 1 THEN (s.ord - 1000000000000)::DOUBLE END, p.po::DOUBLE, t.ts, 0.0),
             s.stage, s.ord) AS k, s.rid, s.turn, s.sid
           FROM s LEFT JOIN (SELECT rid, po FROM px_req WHERE conv IS NOT NULL
                             AND rid IN (SELECT rid FROM s WHERE stage = 0)) p ON p.rid = s.rid
           LEFT JOIN (SELECT rid, min(ts) AS ts FROM ev_slot_key WHERE rid IN (SELECT rid FROM s) GROUP BY rid) t
             ON t.rid = s.rid""",
        # the k-th statistic of a conversation (by messages sent, then start time) goes to its k-th placed turn,
        # after the turns the first statistic's message count says were not measured (when there are more placed
        # turns than statistics). One window pass over the columns it needs gives k, the conversation's count
        # and the first statistic's turn. (Whether a statistic's request id has a slot: a join on the ids some
        # statistic names, each one slot_src row; an IN hashed every slot's id, even when no statistic names one.)
        f"""CREATE TEMP TABLE cs_pick AS
            WITH c AS (SELECT f, n, sub, conversation_id, request_id, turn, all_turns, nstats, row_number() OVER w AS k,
                         first_value(CASE WHEN all_turns THEN 1 WHEN input_num_turns >= 1
                                          THEN (input_num_turns + 1) // 2 ELSE 1 END) OVER w AS first_turn
                       FROM (SELECT f, n, sub, conversation_id, request_id, turn, input_num_turns, start_time_ms,
                               bool_and(turn IS NOT NULL) OVER (PARTITION BY conversation_id) AS all_turns,
                               count(*) OVER (PARTITION BY conversation_id) AS nstats
                             FROM cs WHERE conversation_id IS NOT NULL AND {only_sql})
                       WINDOW w AS (PARTITION BY conversation_id
                         ORDER BY CASE WHEN all_turns THEN 0 ELSE coalesce(input_num_turns, 0) END,
                                  CASE WHEN all_turns THEN 0.0 ELSE coalesce(start_time_ms, 0.0) END, f, n, sub)),
            m AS (SELECT c.*, kn.rid IS NOT NULL AS known, coalesce(np.nplaced, 0) AS nplaced
                  FROM c LEFT JOIN (SELECT conv, count(*) AS nplaced FROM placed GROUP BY conv) np
                    ON np.conv = c.conversation_id
                  LEFT JOIN (SELECT rid FROM slot_src WHERE rid IN (SELECT request_id FROM cs)) kn
                    ON kn.rid = c.request_id),
            o AS (SELECT *, k + CASE WHEN nplaced > nstats THEN first_turn - 1 ELSE 0 END AS kth FROM m)
            SELECT f, n, sub, conversation_id, k, CASE WHEN known THEN request_id END AS rid_match,
              CASE WHEN known OR turn IS NOT NULL THEN NULL WHEN kth <= nplaced THEN kth END AS place,
              CASE WHEN all_turns THEN turn ELSE k END AS nturn, request_id AS own_rid
            FROM o""",
        # a statistic beyond the placed turns: the same-numbered turn without one, else a turn of its own
        """CREATE TEMP TABLE cs_new AS SELECT DISTINCT own_rid AS rid, conversation_id AS conv, nturn AS turn,
             2e12 + k AS ord, 2 AS stage FROM cs_pick
           WHERE rid_match IS NULL AND place IS NULL AND NOT EXISTS (SELECT 1 FROM slot_src s
             WHERE s.conv = cs_pick.conversation_id AND s.turn = cs_pick.nturn)""",
    ]
