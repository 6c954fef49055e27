"""Every verdict rule, stock and instrumented, stated once: the table the engine evaluates for every path.

``RULES`` is read top to bottom; a turn takes the first rule whose ``when`` holds. Each rule is SQL over one
turn's facts (diagnostics/engine_facts.py: the deciding event, the proxy's lookup and lines, P's and D's
lines for the request, the failure, the previous turn, the run's settings, P's stats windows) and says:
the verdict, the confidence, the reason, and the lines that prove it (evidence, in order). A rule with
``with_failure`` adds the turn's own failure to its reason ("; the turn failed (...)") and evidence, or,
when P failed a first attempt on a KV load failure and the client still got its answer, says so.
docs/verdicts.md explains each rule; docs/design.md ("Where a verdict rule lives") shows how to edit one.

    kvdiag explain ... , explain --all, report, advise  ──►  engine (DuckDB)  ──►  RULES (this file)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvdiag.schema.verdicts import VERDICT_INFO, Verdict

TOKEN_MARGIN: Final = 16  # the benchmark counts message content only; a re-tokenized reply may differ a little
DEFAULT_BLOCK_SIZE: Final = 16
CONFIRMED: Final = "'confirmed'"
INFERRED: Final = "'inferred'"


def q(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class Rule:
    """One verdict rule: when it applies, what it decides, why, and the lines that show it."""

    name: str
    when: str
    verdict: str  # SQL: a quoted Verdict value, or an expression
    confidence: str
    reason: str  # SQL string expression
    evidence: tuple[str, ...] = ()  # SQL refs ({source, text}) or lists of refs (suffix "[]"); NULLs dropped
    with_failure: str = "false"  # SQL condition: add the turn's failure to the reason and evidence
    sets: dict[str, str] = field(default_factory=dict)  # table columns the rule states itself
    windows: bool = False  # the rule reads P's stats windows (explain reads them when some turn reaches it)


def v(verdict: Verdict) -> str:
    """The verdict as SQL."""
    return q(verdict.value)


# Facts the rules share (SQL over the turn's facts; see engine_facts.py for each column).
HIT = "px_lookup = 'hit'"
NO_HANDLE = "px_lookup IN ('miss', 'no_handle')"
PREV = "prev_sid IS NOT NULL"
LEG_FAILED = "(has_px AND NOT coalesce(px_has_stored, false) AND NOT coalesce(px_done, false))"
SENT = "coalesce(px_sending, px_last)"
MISS = "coalesce(px_miss, px_last)"
TAIL = ("CASE WHEN NOT coalesce(px_has_stored, false) THEN '; the proxy stored no handle after it, so the turn "
        "may have failed downstream (vLLM logs request failures only with --enable-log-requests)' ELSE '' END")
# D's tokens P could pull with nothing held locally, bounded from below by the benchmark's counts
# (content only, so a token or two a message less than P's count)
REMAINDER_FLOOR = ("CASE WHEN prev_s_input_num_tokens IS NOT NULL AND prev_s_output_num_tokens IS NOT NULL AND "
                   "s_input_num_tokens IS NOT NULL THEN least(prev_s_input_num_tokens + prev_s_output_num_tokens - 1, "
                   "s_input_num_tokens) - 2 * coalesce(nullif(s_input_num_turns, 0), 1) END")
MUST_READ = f"coalesce({REMAINDER_FLOOR} >= ctx_threshold + {TOKEN_MARGIN}, false)"
WINDOW_FOUND = "w_found AND w_rejected IS NULL"
WINDOWS_SAY_NO_CACHING = f"{WINDOW_FOUND} AND ctx_p_bidir IS TRUE AND w_prefix_caching IS FALSE"


RULES: Final[tuple[Rule, ...]] = (
    # ---- instrumented: the router (merged with P's report) or P states the outcome
    Rule("event_outcome", "dec_verdict IS NOT NULL", "dec_verdict",
         f"CASE WHEN dec_inferred THEN {INFERRED} ELSE {CONFIRMED} END",
         "CASE WHEN coalesce(dec_ft, '') <> '' AND NOT contains(base_reason, dec_ft) "
         "THEN base_reason || ' (failure_type=' || dec_ft || ')' ELSE base_reason END",
         ("dec_ref", "eng_refs[1:3][]", "p_refs3[]", "released"),
         with_failure=f"dec_verdict <> {v(Verdict.REQUEST_FAILED)}"),
    # ---- stock logs: what the proxy did with the request
    Rule("proxy_no_conversation_id", "px_lookup = 'no_conversation_id'", v(Verdict.NO_CONVERSATION_ID), CONFIRMED,
         q("the proxy got no conversation_id, so it could not link the turns"), ("px_first",), with_failure="true"),
    Rule("proxy_stale_entry", "px_lookup = 'stale'", v(Verdict.ROUTER_ENTRY_EXPIRED), CONFIRMED,
         "'router entry age ' || px_age || ' s > ttl ' || px_ttl || ' s: discarded'", ("px_first",),
         with_failure="true"),
    # ---- the proxy offered D's handle to P: P's log decides (docs/design.md Contract 4, rules 1–7)
    Rule("p_declined_read", f"{HIT} AND p_decl IS NOT NULL", v(Verdict.EXPIRED_REMOTE_READ), CONFIRMED,
         q("P declined the D→P read: D's blocks expire within 5 s or already did"), (SENT, "p_decl", "released"),
         with_failure="true"),
    Rule("p_transfer_failure", f"{HIT} AND p_nixl IS NOT NULL", v(Verdict.TRANSFER_FAILED), CONFIRMED,
         "'the D→P read failed: NIXL ' || p_nixl_ft", (SENT, "p_nixl"), with_failure="true",
         sets={"failure_type": "p_nixl_ft"}),
    Rule("d_read_after_release", f"{HIT} AND stale_read IS NOT NULL", v(Verdict.EXPIRED_REMOTE_READ), CONFIRMED,
         q("D logged that the blocks offered to this turn were read after it had released them (Potentially "
           "invalid KV blocks): the KV P loaded is not D's"), (SENT, "stale_read"), with_failure="true"),
    Rule("p_skip_local", f"{HIT} AND p_skip IS NOT NULL AND p_skip_n < ctx_block_size", v(Verdict.LOCAL_HIT),
         CONFIRMED, "'P''s prefix cache held all but ' || p_skip_n || ' token(s) (< one block of ' || ctx_block_size "
         "|| '); nothing left to pull'", (SENT, "p_skip"), sets={"remote_offered_tokens": "p_skip_n"}),
    Rule("p_skip_threshold", f"{HIT} AND p_skip IS NOT NULL", v(Verdict.BELOW_THRESHOLD), CONFIRMED,
         "p_skip_n || ' remote tokens < kv_recompute_threshold ' || p_skip_thr || ': P recomputed them'",
         (SENT, "p_skip"), sets={"remote_offered_tokens": "p_skip_n"}),
    Rule("d_released_no_p_log", f"{HIT} AND released IS NOT NULL AND failed_why IS NULL AND NOT ctx_has_prefill",
         v(Verdict.EXPIRED_REMOTE_READ), INFERRED, q("D released the blocks offered to this turn unread (TTL); P's "
                                                     "log would show the declined read"), (SENT, "released")),
    # P declines (WARNING) or fails (ERROR) a read it attempts, visible at INFO: no such line and D's
    # blocks expired unread means P never tried.
    Rule("d_released_unread", f"{HIT} AND released IS NOT NULL AND failed_why IS NULL",
         v(Verdict.FEATURE_DISABLED_ON_PREFILL), INFERRED,
         q("D's blocks offered to this turn expired unread and P logged no read attempt: P ignored the handle"),
         (SENT, "released")),
    Rule("p_kv_load_failed", f"{HIT} AND p_kvfail IS NOT NULL", v(Verdict.TRANSFER_FAILED), INFERRED,
         q("P failed the request on a KV load failure with no expiry line; failure_type unknown at this log "
           "level; the turn failed"), (SENT, "p_kvfail")),
    Rule("p_hung", f"{HIT} AND p_hung IS NOT NULL", v(Verdict.UNKNOWN), INFERRED,
         q("P stuck in WAITING_FOR_REMOTE_KVS after a D→P read (vLLM 0.33 recompute hang); the turn never "
           "completed; P's WARNING lines decide the cause"), (SENT, "p_hung")),
    Rule("p_read_blocks", f"{HIT} AND p_read IS NOT NULL", v(Verdict.REMOTE_HIT), CONFIRMED,
         q("P read D's blocks (D→P)"), (SENT, "p_read"), with_failure="true"),
    Rule("p_started_read", f"{HIT} AND p_start IS NOT NULL AND p_start_local > 0", v(Verdict.REMOTE_HIT), CONFIRMED,
         "'P started the D→P read of ' || p_start_remote || ' block group(s)'", (SENT, "p_start"),
         with_failure="true"),
    # vLLM hands the worker a request with no local block to fill when P's prefix cache already holds
    # every token the handle covers (a skip under the threshold logs its own line, above).
    Rule("p_read_nothing_to_fill", f"{HIT} AND p_start IS NOT NULL", v(Verdict.LOCAL_HIT), CONFIRMED,
         q("P's prefix cache already held every token of D's handle: P's read had no block to fill "
           "(start_load_kv with 0 local blocks) and only told D to release its blocks"), (SENT, "p_start"),
         with_failure="true"),
    Rule("p_without_bidir_line", f"{HIT} AND ctx_p_bidir IS FALSE AND ctx_d_bidir IS TRUE",
         v(Verdict.FEATURE_DISABLED_ON_PREFILL), INFERRED,
         q("D logs 'Bidirectional KV transfer is enabled' but P does not: P ignored D's handle"), (SENT,)),
    Rule("offered_but_failed", f"{HIT} AND failed_why IS NOT NULL", v(Verdict.REQUEST_FAILED), CONFIRMED,
         "'D''s handle was offered, but the turn failed: ' || failed_why", (SENT, "failed_ref")),
    Rule("offered_no_p_log", f"{HIT} AND NOT ctx_has_prefill", v(Verdict.UNKNOWN), INFERRED,
         q("the proxy offered D's handle to P; P's log decides what P did with it (add the prefill log)"), (SENT,)),
    # at DEBUG P logs every D->P decision (read, skip, decline, failure); none at all: it ignored the handle
    Rule("p_debug_silent", f"{HIT} AND ctx_p_debug", v(Verdict.FEATURE_DISABLED_ON_PREFILL), INFERRED,
         q("P's DEBUG log shows no D→P read, skip, decline or failure for this request: P ignored D's handle "
           "(bidirectional_kv_xfer off on P)"), (SENT, "p_first_ref")),
    Rule("prefill_leg_failed", f"{HIT} AND {LEG_FAILED}", v(Verdict.REQUEST_FAILED), INFERRED,
         q("the proxy logged no 'Prefill done' for it and P logged no D→P decline or failure: the prefill leg "
           "failed for another reason"), (SENT,)),
    # ---- P at INFO: its stats windows and the token counts (docs/verdicts.md, "INFO: P's stats windows")
    Rule("windows_account_for_read", f"{HIT} AND {WINDOW_FOUND} AND w_read IS TRUE", v(Verdict.REMOTE_HIT), INFERRED,
         "w_why", (SENT, "w_refs[1:3][]"), with_failure="true", windows=True),
    Rule("windows_count_no_read", f"{HIT} AND {WINDOWS_SAY_NO_CACHING} AND w_read IS FALSE AND NOT {MUST_READ}",
         v(Verdict.BELOW_THRESHOLD), INFERRED,
         "w_why || '; P runs without prefix caching, so nothing was held locally: the remainder was below "
         "kv_recompute_threshold' || coalesce(' ' || ctx_threshold, '') || ' and P recomputed it'",
         (SENT, "w_refs[1:3][]", "w_caching_ref"), with_failure="true", windows=True),
    # Only where no stats window speaks: a window that counts fewer transfers than the reads sharing it
    # says some read made none, and this turn alone cannot tell which one.
    Rule("counts_force_the_pull", f"{HIT} AND {WINDOWS_SAY_NO_CACHING} AND w_read IS NULL AND len(w_refs) = 0 AND "
         f"{MUST_READ} AND coalesce(px_done, false) AND NOT w_recovered", v(Verdict.REMOTE_HIT), INFERRED,
         f"'P runs without prefix caching, so it had to pull all of D''s tokens the prompt repeats, at least ' || "
         f"({REMAINDER_FLOOR}) || ' by the client''s counts, which is not below kv_recompute_threshold ' || "
         "ctx_threshold || '; P logged no decline, failure or recovery for the read and answered the prefill: the "
         "read succeeded'", (SENT, "w_caching_ref", "prev_stat_ref", "stat_ref"), with_failure="true",
         windows=True),
    Rule("p_rejected_handle", f"{HIT} AND w_found AND w_rejected IS NOT NULL", v(Verdict.UNKNOWN), INFERRED,
         f"'the proxy offered D''s handle and ' || w_why || {TAIL}", (SENT, "w_rejected"), windows=True),
    Rule("offered_undecided", HIT, v(Verdict.UNKNOWN), INFERRED,
         "'the proxy offered D''s handle and P logged no failure: remote_hit, local_hit or below_threshold' || "
         "CASE WHEN w_found THEN '; ' || w_why ELSE '' END || '. Stock vLLM logs nothing per request for these at "
         "INFO — run P at VLLM_LOGGING_LEVEL=DEBUG or add prefill events to decide' || " + TAIL,
         (SENT, "CASE WHEN w_found THEN w_refs[1:2] END[]"), windows=True),
    # ---- turn 1 (the client's message count proves it; the proxy's order only suggests it)
    Rule("first_turn_failed", "is_first AND failed_why IS NOT NULL", v(Verdict.REQUEST_FAILED), CONFIRMED,
         "'turn 1 failed: ' || failed_why", ("failed_ref",)),
    Rule("first_turn_leg_failed", f"is_first AND {LEG_FAILED}", v(Verdict.REQUEST_FAILED), INFERRED,
         q("turn 1 failed: the proxy logged no 'Prefill done' for it (the prefill leg failed)"), ("px_first",)),
    Rule("first_turn", "is_first", v(Verdict.FIRST_TURN),
         f"CASE WHEN coalesce(s_input_num_turns <= 2, false) THEN {CONFIRMED} ELSE {INFERRED} END",
         q("first turn of the conversation: nothing to retrieve yet"), ("px_first", "stat_ref")),
    # ---- a later turn the router sent without a handle: why was there none?
    # (after requests that all failed a turn starts afresh, as turn 1 does: if it fails too, that is its verdict)
    Rule("failed_again", f"{NO_HANDLE} AND {PREV} AND earlier_all_failed AND failed_why IS NOT NULL",
         v(Verdict.REQUEST_FAILED), CONFIRMED,
         "'every earlier request of the conversation failed, and so did this one: ' || failed_why",
         ("failed_ref", MISS)),
    Rule("leg_failed_again", f"{NO_HANDLE} AND {PREV} AND earlier_all_failed AND {LEG_FAILED}",
         v(Verdict.REQUEST_FAILED), INFERRED,
         q("every earlier request of the conversation failed, and so did this one: the proxy logged no 'Prefill "
           "done' for it (the prefill leg failed)"), (MISS,)),
    Rule("nothing_ever_answered", f"{NO_HANDLE} AND {PREV} AND earlier_all_failed", v(Verdict.FIRST_TURN), INFERRED,
         q("every earlier request of the conversation failed: nothing to retrieve yet"), (MISS, "prev_px_first")),
    # Later revisions of the example proxy check the history themselves and say when they hold a handle back.
    Rule("proxy_withheld_handle", f"{NO_HANDLE} AND px_withheld IS NOT NULL", v(Verdict.PREFIX_MISMATCH), CONFIRMED,
         "'the proxy held D''s handle back: ' || coalesce(nullif(px_withheld_why, ''), 'history changed') || "
         "' (the new prompt does not extend what D''s blocks hold)'", ("px_withheld", MISS), with_failure="true"),
    Rule("proxy_kept_no_handle", f"{NO_HANDLE} AND {PREV} AND prev_has_not_stored", v(Verdict.PREFIX_MISMATCH),
         CONFIRMED, "'the proxy did not keep turn ' || prev_turn || '''s handle (' || coalesce(nullif(trim("
         "regexp_replace(trim(coalesce(prev_not_stored_why, '')), '^because ', '')), ''), 'no reason given') || "
         "'), so it offered none'", ("prev_not_stored", MISS), with_failure="true"),
    Rule("turn_in_flight", f"{NO_HANDLE} AND {PREV} AND is_concurrent", v(Verdict.CONCURRENT_TURN), INFERRED,
         "'turn ' || prev_turn || ' was still in flight (its D handle was stored after this request arrived)'",
         (MISS,), with_failure="true"),
    Rule("proxy_restarted", f"{NO_HANDLE} AND {PREV} AND prev_has_stored AND restart_ref IS NOT NULL",
         v(Verdict.ROUTER_STATE_LOST), CONFIRMED,
         "'the proxy stored turn ' || prev_turn || '''s handle, then restarted (''Ready'' line) and lost it'",
         ("prev_stored", "restart_ref", MISS), with_failure="true"),
    # The stock proxy pops an entry only on a HIT; kvdiag's router may also withhold it (prefix_mismatch).
    Rule("stored_handle_missed", f"{NO_HANDLE} AND {PREV} AND prev_has_stored", v(Verdict.UNKNOWN), INFERRED,
         "'the proxy stored turn ' || prev_turn || '''s handle, but this turn was a MISS with no stale or restart "
         "line: router_state_lost (another replica) or a handle the router withheld (prefix_mismatch); router "
         "events decide'", ("prev_stored", MISS), with_failure="true"),
    Rule("previous_aborted", f"{NO_HANDLE} AND {PREV} AND prev_aborted IS NOT NULL", v(Verdict.METADATA_NOT_RETURNED),
         CONFIRMED, "'turn ' || prev_turn || ' was aborted, so D returned no kv_transfer_params (aborted)'",
         ("prev_aborted", MISS), with_failure="true"),
    Rule("previous_failed", f"{NO_HANDLE} AND {PREV} AND prev_failed_why IS NOT NULL",
         v(Verdict.METADATA_NOT_RETURNED), CONFIRMED,
         "'turn ' || prev_turn || ' failed (' || prev_failed_why || '), so no handle was stored (decode_failed)'",
         ("prev_failed_ref", MISS), with_failure="true"),
    Rule("d_without_bidir_line", f"{NO_HANDLE} AND {PREV} AND ctx_d_bidir IS FALSE", v(Verdict.METADATA_NOT_RETURNED),
         INFERRED, "'the proxy stored no handle after turn ' || prev_turn || ' and D''s log has no ''Bidirectional KV "
         "transfer is enabled'' line: bidirectional KV transfer is off on D (bidirectional_off_on_decode)'", (MISS,),
         with_failure="true"),
    Rule("d_streamed_no_params", f"{NO_HANDLE} AND {PREV} AND ctx_d_bidir IS TRUE", v(Verdict.METADATA_NOT_RETURNED),
         INFERRED, "'D has bidirectional on, yet the proxy stored no handle after turn ' || prev_turn || ': the "
         "streamed response carried no kv_transfer_params, as vLLM without PR #40186 does (not_streamed)'", (MISS,),
         with_failure="true"),
    Rule("no_handle_stored", f"{NO_HANDLE} AND {PREV}", v(Verdict.METADATA_NOT_RETURNED), INFERRED,
         "'the proxy stored no handle after turn ' || prev_turn || '; D''s log would say why (bidirectional off, "
         "abort)'", (MISS,), with_failure="true"),
    Rule("previous_turn_missing", NO_HANDLE, v(Verdict.UNKNOWN), INFERRED,
         q("a later turn without a handle, and the previous turn is not in the logs: add the earlier proxy log "
           "(rotated file) or router events"), (MISS,)),
    # ---- no router line names the turn
    Rule("client_sent_no_id", "NOT has_px AND ctx_has_router AND has_stat", v(Verdict.NO_CONVERSATION_ID),
         INFERRED, q("no router/proxy line names this conversation: the client most likely sent no conversation_id "
                     "(the proxy log then shows '[id] No conversation_id provided')"), ("stat_ref",)),
    Rule("turn_failed", "failed_why IS NOT NULL", v(Verdict.REQUEST_FAILED), CONFIRMED,
         "'the turn failed: ' || failed_why", ("failed_ref",)),
    Rule("undecidable", "true", v(Verdict.UNKNOWN), INFERRED,
         "'the logs given cannot decide this turn: add ' || CASE WHEN NOT ctx_has_router THEN 'the router''s proxy "
         "log (--proxy-log) or router events' ELSE 'P''s log' END", ("stat_ref",)),
)

# What a failed turn adds to a rule's reason, and what an answered turn after P's failed first attempt says.
FAILED_SUFFIX: Final = "rtrim({reason}, '.') || '; the turn failed (' || failed_why || ')'"
RETRIED: Final = ("rtrim({reason}, '.') || '; P failed that attempt on KV load failure (failure_policy=fail), yet the "
                  "client got its answer' || CASE WHEN contains({reason}, 'retried without the handle') THEN '' "
                  "ELSE ' after a retry without the handle' END")
# A stock proxy given no kv_transfer_params by P goes on to D with the request as it was, D's own handle
# from the previous turn included, and D computes the prompt itself.
ANSWERED: Final = ("rtrim({reason}, '.') || '; P failed that prefill on KV load failure (failure_policy=fail), yet "
                   "the client got its answer: the decode leg went ahead without P''s KV'")


_DECIDED: Final = ("reason", "evidence", "wants_windows", "rule", "verdict", "confidence")


def summary_sql(column: str) -> str:
    """SQL for the summary of the verdict named in ``column`` (the reason when an event states none)."""
    whens = " ".join(f"WHEN {v(x)} THEN {q(VERDICT_INFO[x].summary)}" for x in Verdict)
    return f"CASE {column} {whens} END"


def _evidence(items: tuple[str, ...]) -> str:
    parts = [f"[{item}]" if not item.endswith("[]") else f"coalesce({item[:-2]}, [])" for item in items]
    return "list_filter(" + (" || ".join(parts) if parts else "[]") + ", lambda x: x IS NOT NULL)"


# a keyword at the top level of a rule's condition: the word, then any whitespace (a rule may span lines)
_TOP_WORD: Final = re.compile(r"(AND|OR|CASE|BETWEEN)\s", re.IGNORECASE)


def _conjuncts(when: str) -> list[str] | None:
    """``when``'s top-level AND terms, or None when it is not a plain conjunction (an OR, CASE or BETWEEN outside
    parentheses)."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(when):
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch in "()":
            depth += 1 if ch == "(" else -1
        elif not quoted and depth == 0 and (i == 0 or when[i - 1].isspace()) and (m := _TOP_WORD.match(when, i)):
            if m.group(1).upper() != "AND":
                return None
            parts.append(when[start:i].strip())
            start = m.end()
    return [*parts, when[start:].strip()]


def _pick(rules: Sequence[tuple[int, list[str]]]) -> str:
    """The WHEN branches that give the first rule holding (rules as (number, conjuncts)). A run of rules that
    share their first conjunct and ends with the rule that is that conjunct alone tests it once, as a nested
    CASE: its last rule holds whenever the conjunct does, and none of the run holds when it does not."""
    out, i = [], 0
    while i < len(rules):
        no, terms = rules[i]
        j = i
        if len(terms) > 1:
            while j + 1 < len(rules) and rules[j + 1][1][0] == terms[0] and len(rules[j + 1][1]) > 1:
                j += 1
        if j > i and j + 1 < len(rules) and rules[j + 1][1] == [terms[0]]:
            inner = [(n, t[1:]) for n, t in rules[i:j + 1]] + [(rules[j + 1][0], ["true"])]
            out.append(f"WHEN {terms[0]} THEN CASE {_pick(inner)} END")
            i = j + 2
            continue
        out.append(f"WHEN {' AND '.join(terms)} THEN {no}")
        i += 1
    return " ".join(out)


def _by_number(branches: Sequence[tuple[int, str]], otherwise: str = "NULL") -> str:
    """SQL for the value of rule number ``rule_no``, from (number, SQL) pairs."""
    if not branches:
        return otherwise
    return f"CASE rule_no {' '.join(f'WHEN {i} THEN {x}' for i, x in branches)} ELSE {otherwise} END"


@functools.cache
def pick_sql() -> str:
    """SQL for the number of the first rule that holds for a turn (its index in RULES)."""
    split = [(i, _conjuncts(r.when)) for i, r in enumerate(RULES)]
    return "CASE " + _pick([(i, terms if terms is not None else [f"({RULES[i].when})"]) for i, terms in split]) \
        + " END"


def decide_sql(source: str, keep: Sequence[str], *, evidence: bool = True,
               picked: Collection[int] | None = None) -> str:
    """One SELECT over ``source`` (the turns' facts): the columns in ``keep``, and each turn's rule, verdict,
    confidence, reason and evidence, and the columns a rule states itself. Without ``evidence`` the
    evidence column is NULL (the turn table reads none). With ``picked``, ``source`` already has each turn's
    ``rule_no`` (:func:`pick_sql`) and holds only these: the other rules' verdicts, reasons and evidence are
    left out (DuckDB binds every branch of a CASE, a few rows' run pays for them all otherwise)."""
    numbered = [(i, r) for i, r in enumerate(RULES) if picked is None or i in picked]

    def by_rule(attr: str) -> str:
        # the rules' constants by a list index (one lookup, not a test per rule), the others by their number
        said = [getattr(r, attr) for r in RULES]
        if picked is not None:
            return _by_number([(i, said[i]) for i, _ in numbered])
        const = [x if re.fullmatch(r"'[^']*'|true|false", x) else None for x in said]
        whens = " ".join(f"WHEN {i} THEN {x}" for i, x in enumerate(said) if const[i] is None)
        return f"CASE rule_no {whens} ELSE [{', '.join(x or 'NULL' for x in const)}][rule_no + 1] END"

    evidence_sql = _by_number([(i, _evidence(r.evidence)) for i, r in numbered])
    sets = sorted({k for r in RULES for k in r.sets})
    overrides = ", ".join(
        f"{_by_number([(i, r.sets[k]) for i, r in numbered if k in r.sets], k)} AS {k}" for k in sets)
    base = f"coalesce(nullif(dec_reason, ''), {summary_sql('dec_verdict')})"
    reason = _by_number([(i, r.reason.replace("base_reason", base)) for i, r in numbered])
    failing = FAILED_SUFFIX.format(reason="r0")
    retried = RETRIED.format(reason="r0")
    answered = ANSWERED.format(reason="r0")
    windows = ", ".join(str(i) for i, r in enumerate(RULES) if r.windows)
    ev0 = f"{evidence_sql} AS ev0, " if evidence else ""
    evidence_out = """ev0 || CASE WHEN NOT wf THEN [] WHEN failed_why IS NOT NULL THEN list_filter([failed_ref],
                lambda x: x IS NOT NULL)
              WHEN p_kvfail IS NOT NULL AND answered THEN list_filter([p_kvfail, CASE WHEN NOT has_ev
                THEN answer_proof END], lambda x: x IS NOT NULL) ELSE [] END""" if evidence else "NULL::BIGINT[]"
    rule_no = "" if picked is not None else f", {pick_sql()} AS rule_no"
    return f"""
WITH picked AS (SELECT *{rule_no} FROM {source}),
said AS (SELECT *, {by_rule('verdict')} AS verdict, {by_rule('confidence')} AS confidence, {reason} AS r0,
           {ev0}{by_rule('with_failure')} AS wf FROM picked)
SELECT {', '.join(c for c in keep if c not in sets and c not in _DECIDED)}, {overrides},
  CASE WHEN NOT wf THEN r0 WHEN failed_why IS NOT NULL THEN {failing}
       WHEN p_kvfail IS NOT NULL AND answered THEN CASE WHEN has_ev THEN {retried} ELSE {answered} END
       ELSE r0 END AS reason,
  {evidence_out} AS evidence,
  rule_no IN ({windows or '-1'}) AS wants_windows,
  {[r.name for r in RULES]}[rule_no + 1] AS rule, verdict, confidence
FROM said"""
