"""The proxy log's lines into ``pl``, in DuckDB: proxy_log.classify_proxy_message's kinds and groups, in SQL.

One row per line a classifier takes: ``f``, ``n``, ``seq`` (the line's place), the time stamp ``ts``, ``kind``,
one column per named group of the classifiers (NULL where the kind has none) and ``cconv`` (the conversation,
which the join later maps from a hashed tag). The patterns are the parser's own, read by RE2 as Python reads them
(engine_parse._re2).
"""

from __future__ import annotations

import re
from typing import Final

from kvdiag.diagnostics import proxy_log_parser as proxy_log
from kvdiag.diagnostics.engine_parse import _RTRIM_CR, _literal, _re2, sql_str
from kvdiag.diagnostics.proxy_log_parser import CLASSIFIERS as PROXY_CLASSIFIERS
from kvdiag.diagnostics.proxy_log_parser import PROXY_RE

_PROXY_NAMES: Final = ("conv", "age", "ttl", "remote", "blocks", "rid", "why", "ms", "detail", "p", "d")

# Groups of the common proxy lines cut out by position: the kind's pattern (matched without captures, which
# RE2 runs several times faster) proves the shape. Each such pattern starts with an id: a request id ("[rid] ",
# which holds no "]") or a conversation id ("conv=conv: ", which holds no space), so the id ends at the
# message's first "]" or first ": " (``q``, found once per line). The text after it tells the kinds apart
# before any pattern runs (``w``), and the groups are cut from there in steps: each group starts after a
# literal and ends at the first text its class excludes, which the next literal starts with (a letter for
# numbers, ")" or "," for ids, ": " for a conversation id). A step's text (``a1``, ``a2``) and its end
# (``p1``, ``p2``) are columns: every later cut reads them instead of searching the message again.
_ID_END: Final = {"[": "strpos(msg, ']')", "c": "strpos(msg, ': ')"}  # by the message's first character
_ID_GROUP: Final = {"[": ("rid", "substr(msg, 2, q - 2)"), "c": ("conv", "substr(msg, 6, q - 6)")}
_WORD: Final = 9  # characters of w: enough to tell apart every kind whose pattern has a literal there
_PROXY_STEPS: Final[dict[str, tuple[tuple[str, str, str | None], ...]]] = {
    # kind: (group, the literal before it (the first starts at the id's end), the text that ends it: None for
    # the message's end)
    "stale": (("age", ": stale cache entry (age=", "s"), ("ttl", "s > ttl=", "s")),
    "hit": (("age", ": cache HIT (age=", "s"),),
    "cached": (("remote", ": cached D blocks (remote_request_id=", ","), ("blocks", ", blocks=", ")")),
    "no_conversation_id": (),
    "sending": (("conv", "] conv=", ": "), ("remote", ": sending D's cached blocks to P (remote_request_id=", ")")),
    "no_handle": (("conv", "] conv=", ": "),),
    # "cache MISS" then, optionally, " (why)": the why ends at the first ")" ('' is no why)
    "miss": (("conv", "] conv=", ": "), ("why", ": cache MISS", None)),
    "prefill_done": (("ms", "] Prefill done in ", "m"),),
    "prefill_failed": (("detail", "] Prefill request failed: ", None),),
    "decode_failed": (("detail", "] Decode request failed: ", None),),
}
_FINISH: Final = {("miss", "why"): "CASE WHEN starts_with({0}, ' (') AND strpos(substr({0}, 3), ')') > 0 "
                                   "THEN nullif(split_part(substr({0}, 3), ')', 1), '') END"}


def _step_sql(prev: str, at: str, literal: str) -> str:
    return f"substr({prev}, {at} + {len(literal)})"


def _proxy_cuts() -> dict[str, dict[str, str]]:
    """Each cut kind's groups, over q and the steps' columns (a literal that does not continue the pattern, or
    an end its next literal does not start with, raises: the cut would not be the pattern's group)."""
    cuts: dict[str, dict[str, str]] = {}
    for kind, regex in PROXY_CLASSIFIERS:
        steps = _PROXY_STEPS.get(kind)
        if steps is None:
            continue
        lead = proxy_log._lead(regex)
        runs = [_literal(run) or "" for run in re.findall(r"(?:\\[^A-Za-z0-9]|[^\\^$.|?*+()\[\]{}])+", regex.pattern)]
        if kind in cuts or lead not in _ID_GROUP or any(not any(s[1] in run for run in runs) for s in steps):
            raise ValueError(f"proxy kind {kind!r}: its cut steps do not follow its pattern")
        group, cut = _ID_GROUP[lead]
        cuts[kind] = {group: cut}
        for j, (name, _lit, end) in enumerate(steps, start=1):
            following = steps[j][1] if j < len(steps) else None
            if end is not None and following is not None and not following.startswith(end):
                raise ValueError(f"proxy kind {kind!r}: the end of {name!r} must start the next literal")
            value = f"a{j}" if end is None else f"left(a{j}, p{j} - 1)"
            cuts[kind][name] = _FINISH.get((kind, name), "{0}").format(value)
    return cuts


_PROXY_CUTS: Final = _proxy_cuts()
# PROXY_RE up to its message, for the line check: a line holds no newline, so "(?P<msg>.*)$" matches whatever
# follows (and RE2 stops at the prefix instead of scanning to the end)
_PROXY_MSG: Final = "(?P<msg>.*)$"
if not PROXY_RE.pattern.endswith(_PROXY_MSG):
    raise ValueError("PROXY_RE must end with its message group (the head check cuts it off)")
PROXY_HEAD_RE: Final = re.compile(PROXY_RE.pattern[:-len(_PROXY_MSG)])


def _marker(regex: re.Pattern[str]) -> str:
    """The longest literal run of the pattern (every line of its kind contains it): a cheap test first."""
    runs = re.findall(r"(?:\\.|[^\\()\[\]?*+{}|^$.])+", regex.pattern)
    literals = [re.sub(r"\\(.)", r"\1", r) for r in runs if not re.search(r"\\[dDsSwWbB]", r)]
    return max(literals, key=len)


_ID_RE: Final = {"[": re.escape(r"^\[(?P<rid>[^\]]+)\] "), "c": re.escape(r"^conv=(?P<conv>\S+?): ")}


def _kind_test(regex: re.Pattern[str]) -> str:
    """The line's test for the kind: cheap tests every line of the kind passes (the first character, then the
    literal right after the id (w), else the pattern's longest literal), then the pattern."""
    lead = proxy_log._lead(regex)
    test = f"lead = {sql_str(lead)}"
    after = re.match(_ID_RE.get(lead, "(?!)") + r"((?:\\[^A-Za-z0-9]|[^\\^$.|?*+()\[\]{}])*)", regex.pattern)
    word = (_literal(after.group(1)) or "")[:_WORD] if after else ""
    if len(word) == _WORD:
        return f"{test} AND w = {sql_str(word)} AND {_matches(regex)}"
    test += f" AND starts_with(w, {sql_str(word)})" if word else ""
    return f"{test} AND contains(msg, {sql_str(_marker(regex))}) AND {_matches(regex)}"


def _matches(regex: re.Pattern[str]) -> str:
    """The pattern itself, which decides (the tests before it only pass over the lines it cannot match)."""
    return f"regexp_matches(msg, {sql_str(_re2(regex))})"


def _by_kind(exprs: dict[int, str]) -> str:
    """One CASE over k, the kinds with the same expression in one branch (NULL for the others)."""
    by_value: dict[str, list[int]] = {}
    for i, value in exprs.items():
        by_value.setdefault(value, []).append(i)
    whens = [f"WHEN k IN ({', '.join(map(str, ks))}) THEN {value}" for value, ks in by_value.items()]
    return f"CASE {' '.join(whens)} END" if whens else "NULL"


def parse_proxy_sql() -> list[str]:
    """Statements: ``pl`` from lines_proxy, kinds and groups as proxy_log.classify_proxy_message gives."""
    kinds = [f"WHEN {_kind_test(regex)} THEN {i}"
             for i, (_kind, regex) in enumerate(PROXY_CLASSIFIERS)]
    steps: list[tuple[dict[int, str], dict[int, str]]] = [({}, {}), ({}, {})]
    for i, (kind, _regex) in enumerate(PROXY_CLASSIFIERS):
        at = "q"
        for j, (_name, literal, end) in enumerate(_PROXY_STEPS.get(kind, ())):
            steps[j][0][i] = _step_sql("msg" if j == 0 else f"a{j}", at, literal)
            if end is not None:
                steps[j][1][i] = f"strpos(a{j + 1}, {sql_str(end)})"
            at = f"p{j + 1}"
    fields = []
    for name in _PROXY_NAMES:
        exprs: dict[int, str] = {}
        for i, (kind, regex) in enumerate(PROXY_CLASSIFIERS):
            if name not in regex.groupindex:
                continue
            if name in _PROXY_CUTS.get(kind, {}):
                exprs[i] = _PROXY_CUTS[kind][name]
            else:
                # regexp_extract gives '' for a group that took no part: an optional group's '' is no value
                value = f"regexp_extract(msg, {sql_str(_re2(regex))}, {regex.groupindex[name]})"
                exprs[i] = f"nullif({value}, '')" if name in _optional_groups(regex) else value
        fields.append(f"{_by_kind(exprs)} AS {name}")
    kind_names = " ".join(f"WHEN {i} THEN '{kind}'" for i, (kind, _r) in enumerate(PROXY_CLASSIFIERS))
    ends = " ".join(f"WHEN {sql_str(lead)} THEN {end}" for lead, end in _ID_END.items())
    stepped = "c"
    for j, (texts, positions) in enumerate(steps, start=1):
        stepped = (f"(SELECT *, {_by_kind(positions)} AS p{j} FROM "
                   f"(SELECT *, {_by_kind(texts)} AS a{j} FROM {stepped}))")
    # PROXY_RE's groups by position: the time, "[LEVEL]", the logger's name (no space, no colon), ": ", message;
    # the time and level hold no ": ", so the first is the one after the name
    msg = "substr(t, strpos(t, ': ') + 2)"
    return [
        # seq orders the lines: files in reading order, then lines. The kind is computed once, in one
        # projection with the groups; the lines no classifier takes are deleted after (as a filter, DuckDB
        # would run the patterns twice, and a materialized step copies every line)
        f"""CREATE TEMP TABLE pl AS
            WITH m AS (SELECT f, n, left(t, 19) AS ts, {msg} AS msg, left({msg}, 1) AS lead
                FROM (SELECT f, n, {_RTRIM_CR.format('line')} AS t FROM lines_proxy WHERE line IS NOT NULL)
                WHERE regexp_matches(t, {sql_str(_re2(PROXY_HEAD_RE))})),
            i AS (SELECT *, substr(msg, q + 2, {_WORD}) AS w FROM (SELECT *, CASE lead {ends} END AS q FROM m)),
            c AS (SELECT *, CASE {' '.join(kinds)} END AS k FROM i)
            SELECT *, conv AS cconv, (f::BIGINT << 40) + n AS seq FROM (
              SELECT f, n, ts, CASE k {kind_names} END AS kind, {', '.join(fields)} FROM {stepped})""",
        "DELETE FROM pl WHERE kind IS NULL",
    ]


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
