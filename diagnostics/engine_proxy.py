"""The proxy log's lines into ``pl``, in DuckDB: the proxy log parser's kinds and groups, in SQL.

One row per line a classifier takes: ``f``, ``n``, ``seq`` (the line's place), the time stamp ``ts``, ``kind``,
one column per named group of the classifiers (NULL where the kind has none) and ``cconv`` (the conversation,
which the join later maps from a hashed tag). The patterns are the parser's own, rewritten so that RE2 reads them
as Python does.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterable
from typing import Final

from kvdiag.diagnostics import proxy_log_parser as proxy_log
from kvdiag.diagnostics.engine_parse import _RTRIM_CR, _literal, _re2, ascii_form, kind_case, sql_str
from kvdiag.diagnostics.proxy_log_parser import CLASSIFIERS as PROXY_CLASSIFIERS
from kvdiag.diagnostics.proxy_log_parser import PROXY_RE

# pl's group columns: every named group of the classifiers, each a column (NULL where a kind has none)
PROXY_GROUPS: Final = tuple(dict.fromkeys(g for _kind, regex in PROXY_CLASSIFIERS for g in regex.groupindex))

# The common kinds' groups are read in the RE2 pass that matches them: RE2 reads a one-pass pattern's groups
# (at each character the next step is certain) about as fast as it matches it. Their patterns are, but for the
# conversation id: in "conv=(\S+?): " a ":" may be the id's or the literal's, so it is read as "conv=(\S+) ",
# which takes the same lines once the id read that way ends with ":" after at least one character (the id holds
# no space: the first space ends both), the id being that text less its ":". Each of these patterns starts with
# an id: a request id ("[rid] ", which holds no "]") or a conversation id ("conv=id: "), so the id ends at the
# message's first "]" or first ": " (``q``); the text right after it (``w``) tells the kinds apart before any
# pattern runs.
_ID_END: Final = {"[": "strpos(msg, ']')", "c": "strpos(msg, ': ')"}  # by the message's first character
_WORD: Final = 9  # characters of w: enough to tell apart every kind whose pattern has a literal there
_ONE_PASS: Final = ("stale", "hit", "cached", "no_conversation_id", "sending", "no_handle", "miss", "prefill_done",
                    "prefill_failed", "decode_failed")
_LAZY_CONV: Final = r"conv=(?P<conv>\S+?): "
_IDS: Final = (r"^\[(?P<rid>[^\]]+)\] ", "^")  # what may come before the conversation id
_CONV_READ: Final = "length({0}) >= 2 AND ends_with({0}, ':')"  # a greedy read is the pattern's conversation id


def _one_pass_form(regex: re.Pattern[str], form: Callable[[re.Pattern[str]], str] = _re2) -> str:
    """The pattern as RE2 reads it (``form``), its conversation id (where it has one, never in an optional part)
    read greedily up to the space."""
    src = regex.pattern
    if _LAZY_CONV not in src:
        return form(regex)
    if src.count(_LAZY_CONV) != 1 or not any(src.startswith(before + _LAZY_CONV) for before in _IDS):
        raise ValueError(f"proxy pattern {regex.pattern!r}: its conversation id is not where it can be read greedily")
    return form(re.compile(src.replace(_LAZY_CONV, r"conv=(?P<conv>\S+) "), regex.flags))


@functools.cache
def _one_pass_forms(ascii_only: bool) -> dict[str, str]:
    """The one-pass kinds' patterns by kind, as RE2 reads them the same way on any text (or on ASCII text)."""
    form = ascii_form if ascii_only else _re2
    return {kind: _one_pass_form(regex, form) for kind, regex in PROXY_CLASSIFIERS if kind in _ONE_PASS}


_FORMS: Final = _one_pass_forms(False)

# PROXY_RE up to its message, for the line check: a line holds no newline, so "(?P<msg>.*)$" matches whatever
# follows (and RE2 stops at the prefix instead of scanning to the end)
_PROXY_MSG: Final = "(?P<msg>.*)$"
if not PROXY_RE.pattern.endswith(_PROXY_MSG):
    raise ValueError("PROXY_RE must end with its message group (the head check cuts it off)")
PROXY_HEAD_RE: Final = re.compile(PROXY_RE.pattern[:-len(_PROXY_MSG)])


def longest_literal(regex: re.Pattern[str]) -> str:
    """The longest literal run of the pattern (every line of its kind contains it): a cheap test first."""
    runs = re.findall(r"(?:\\.|[^\\()\[\]?*+{}|^$.])+", regex.pattern)
    literals = [re.sub(r"\\(.)", r"\1", r) for r in runs if not re.search(r"\\[dDsSwWbB]", r)]
    return max(literals, key=len)


_ID_RE: Final = {"[": re.escape(r"^\[(?P<rid>[^\]]+)\] "), "c": re.escape(r"^conv=(?P<conv>\S+?): ")}


def _kind_test(regex: re.Pattern[str]) -> str:
    """Cheap tests every line of the kind passes, before its pattern: the first character, then the literal
    right after the id (w), else the pattern's longest literal."""
    lead = proxy_log._lead(regex)
    test = f"lead = {sql_str(lead)}"
    after = re.match(_ID_RE.get(lead, "(?!)") + r"((?:\\[^A-Za-z0-9]|[^\\^$.|?*+()\[\]{}])*)", regex.pattern)
    word = (_literal(after.group(1)) or "")[:_WORD] if after else ""
    if len(word) == _WORD:
        return f"{test} AND w = {sql_str(word)}"
    test += f" AND starts_with(w, {sql_str(word)})" if word else ""
    return f"{test} AND contains(msg, {sql_str(longest_literal(regex))})"


def _matched(x: str, regex: re.Pattern[str]) -> str:
    """Whether the groups ``x`` (regexp_extract of the one-pass form: '' in every group where it did not match)
    are a match of the pattern: its conversation id read as the pattern reads it, else its first group (never
    empty in a match) set."""
    if "conv" in regex.groupindex:
        return _CONV_READ.format(f"{x}.conv")
    return f"{x}.{next(iter(regex.groupindex))} <> ''"


def _by_kind(exprs: dict[int, str]) -> str:
    """One CASE over k, the kinds with the same expression in one branch (NULL for the others)."""
    by_value: dict[str, list[int]] = {}
    for i, value in exprs.items():
        by_value.setdefault(value, []).append(i)
    whens = [f"WHEN k IN ({', '.join(map(str, ks))}) THEN {value}" for value, ks in by_value.items()]
    return f"CASE {' '.join(whens)} END" if whens else "NULL::VARCHAR"


def kinds_present(lines: Iterable[str]) -> set[int]:
    """The classifiers (by index) whose pattern's longest literal one of ``lines`` holds: no other can take one."""
    texts = list(lines)
    literals = [longest_literal(regex) for _kind, regex in PROXY_CLASSIFIERS]
    return {i for i, literal in enumerate(literals) if any(literal in t for t in texts)}


def parse_proxy_sql(present: Collection[int] | None = None, *, all_ascii: bool = False, cr: bool = True,
                    merged: bool = False) -> list[str]:
    """Statements: ``pl`` from lines_proxy, kinds and groups as proxy_log.classify_proxy_message gives.
    ``present``: the classifiers that can take a line (kinds_present), when known; the others are left out.
    ``all_ascii``: every line of lines_proxy is ASCII, and the patterns take their ASCII forms (a Unicode class
    costs RE2 ten times as long to compile, which a few lines' run pays for and never gets back). Without ``cr``
    no line of lines_proxy ends with a carriage return (none is trimmed). ``merged``: lines_proxy holds several proxy
    logs (a router's replicas), and pl gets ``po``, their lines' place in time (line_order)."""
    classes = [(i, kind, regex) for i, (kind, regex) in enumerate(PROXY_CLASSIFIERS) if present is None or i in present]
    form, forms = (ascii_form if all_ascii else _re2), _one_pass_forms(all_ascii)
    kinds, groups = [], []
    for i, kind, regex in classes:
        if kind in _FORMS:
            names = "[" + ", ".join(sql_str(g) for g in regex.groupindex) + "]"
            groups.append(f"CASE WHEN {_kind_test(regex)} THEN regexp_extract(msg, {sql_str(forms[kind])}, {names}) "
                          f"END AS x{i}")
            kinds.append(f"WHEN {_matched(f'x{i}', regex)} THEN {i}")
        else:
            kinds.append(f"WHEN {_kind_test(regex)} AND regexp_matches(msg, {sql_str(form(regex))}) THEN {i}")
    fields = []
    for name in PROXY_GROUPS:
        exprs: dict[int, str] = {}
        for i, kind, regex in classes:
            if name not in regex.groupindex:
                continue
            if kind in _FORMS:  # (the greedy conversation id less its ":")
                value = f"left(x{i}.conv, length(x{i}.conv) - 1)" if name == "conv" else f"x{i}.{name}"
            else:
                value = f"regexp_extract(msg, {sql_str(form(regex))}, {regex.groupindex[name]})"
            # regexp_extract gives '' for a group that took no part: an optional group's '' is no value
            exprs[i] = f"nullif({value}, '')" if name in _optional_groups(regex) else value
        fields.append(f"{_by_kind(exprs)} AS {name}")
    kind_name = kind_case(((i, kind) for i, (kind, _r) in enumerate(PROXY_CLASSIFIERS)),
                          (kind for kind, _r in PROXY_CLASSIFIERS))
    ends = " ".join(f"WHEN {sql_str(lead)} THEN {end}" for lead, end in _ID_END.items())
    # PROXY_RE's groups by position: the time, "[LEVEL]", the logger's name (no space, no colon), ": ", message;
    # the time and level hold no ": ", so the first is the one after the name
    # The message starts at p. Its first character and the word w are cut from the line, not from the message:
    # DuckDB knows a stored column's text is ASCII and then cuts it by byte position, while it scans a computed
    # string (the message, a trimmed line) character by character from its start.
    t = _RTRIM_CR.format("line") if cr else "line"
    rows = f"""SELECT *, conv AS cconv, (f::BIGINT << 40) + n AS seq FROM (
              SELECT f, n, ts{', stamp' if merged else ''}, {kind_name} AS kind, {', '.join(fields)} FROM c)"""
    return [
        # seq is a line's ref (and its order in one log: line_order). The kind is computed once, in one
        # projection with the groups; the lines no classifier takes are deleted after (as a filter, DuckDB
        # would run the patterns twice, and a materialized step copies every line)
        f"""CREATE TEMP TABLE pl AS
            WITH m AS (SELECT f, n, t, p, left(t, 19) AS ts{_STAMP if merged else ''}, substr(t, p) AS msg,
                  substr(t, p, 1) AS lead
                FROM (SELECT f, n, t, strpos(t, ': ') + 2 AS p
                      FROM (SELECT f, n, {t} AS t FROM lines_proxy WHERE line IS NOT NULL)
                      WHERE regexp_matches(t, {sql_str(form(PROXY_HEAD_RE))}))),
            i AS (SELECT * EXCLUDE (t, p), substr(t, p + q + 1, {_WORD}) AS w
                  FROM (SELECT *, CASE lead {ends} END AS q FROM m)),
            c AS (SELECT *, {f"CASE {' '.join(kinds)} END" if kinds else 'NULL::INTEGER'} AS k
                  FROM (SELECT *{''.join(', ' + g for g in groups)} FROM i))
            {_in_time(rows) if merged else rows}""",
        "DELETE FROM pl WHERE kind IS NULL",
    ]


def line_order(merged: bool) -> str:
    """The column of pl that orders its lines in time: ``po`` with several proxy logs (``merged``), else ``seq``
    (one log's lines are in time order)."""
    return "po" if merged else "seq"


# A line's whole stamp (its fraction of a second too, where the log has one: "%(asctime)s" writes ",123"), as
# text that sorts in time across logs: "T" or " " between the date and the time alike, "," or "." before the
# fraction alike. (The fraction's digits sort as a decimal's; a stamp without one sorts before those of its second.)
_STAMP: Final = (", left(t, 10) || ' ' || substr(t, 12, 8) || replace(substr(t, 20, strpos(t, ' [') - 20), ',', '.') "
                 "AS stamp")


def _in_time(rows: str) -> str:
    """``rows`` (pl's lines of several proxy logs: a router's replicas, each logging the requests it served) with
    ``po``, their place in time: the latest stamp of its log up to the line (a log's own order always holds, a
    clock stepping back included), ties between logs broken by the logs' order; ``stamp`` stays (a conversation's
    requests that share one across the logs are ordered again by the correlation's px_order)."""
    return ("SELECT * EXCLUDE (tmax), row_number() OVER (ORDER BY tmax, f, n) AS po FROM (SELECT *, "
            f"max(stamp) OVER (PARTITION BY f ORDER BY n ROWS UNBOUNDED PRECEDING) AS tmax FROM ({rows}))")


def _optional_groups(regex: re.Pattern[str]) -> set[str]:
    """The named groups inside an optional part of the pattern ("(...)?" or "(...)*")."""
    src, stack, spans = regex.pattern, [], []
    i = 0
    while i < len(src):
        if src[i] == "\\":
            i += 2
            continue
        if src[i] == "[":  # a character class: its brackets and parentheses are literal
            i = src.index("]", i + 2 if src[i + 1:i + 2] in ("]", "^") else i + 1) + 1
            continue
        if src[i] == "(":
            stack.append(i)
        elif src[i] == ")" and stack:
            start = stack.pop()
            if i + 1 < len(src) and src[i + 1] in "?*":
                spans.append((start, i))
        i += 1
    return {name for name in regex.groupindex
            if any(a < src.index(f"(?P<{name}>") < b for a, b in spans)}
