"""Internal: the lines one conversation's explanation reads, found with a byte-level prefilter.

First the lines naming the conversation (or its hashed tag), then the lines naming its request ids. A request
of it that another conversation id names too (one log says "a", another "b" for the same request) links the two:
their lines are read as well, round after round, so the engine sees what it sees when it reads every line.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.diagnostics.conversation_ids import id_tags
from kvdiag.diagnostics.detect import LogFile, LogReadError
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_numbered
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log_parser import parse_proxy_numbered
from kvdiag.diagnostics.scan import grep_prefixed, head_lines, is_stats_document
from kvdiag.schema.request_ids import header_request_id

Numbered = list[tuple[int, bytes]]
Tick = Callable[[int], None]

HEAD_KEYWORDS: Final = (b"Bidirectional KV transfer is enabled", b"remote block size")
HEAD_BYTES: Final = 4 * 1024 * 1024  # engine settings are logged at startup
MAX_ROUNDS: Final = 4  # rounds of linked conversations before the caller reads every line instead
MAX_LINKED: Final = 32  # conversation ids read together before the caller reads every line instead

# Characters every JSON writer leaves as they are. Others may come escaped, each writer its own way: Python's
# \u00df, C#'s \u00DF and \u002B for "+", Go's \u003c for "<", "\/" for "/"; an id holding one is looked for
# by its longest run of these (at least MIN_RUN of them), and the engine keeps only its own lines.
_JSON_VERBATIM: Final = re.compile(r"[A-Za-z0-9_.:\- ]+")
MIN_RUN: Final = 3


@dataclass
class Selected:
    """What the prefilter kept: each file's numbered lines, the conversation ids read (the asked one first), the
    request ids found, whether a line names the asked conversation, and whether the links stayed in bounds."""

    kept: dict[str, Numbered] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    named: bool = False  # some line names the asked conversation (with or without a request id)
    request_ids: set[str] = field(default_factory=set)
    complete: bool = True  # False: the links went past MAX_ROUNDS or MAX_LINKED (read every line instead)

    def add(self, found: dict[str, Numbered]) -> None:
        for path, lines in found.items():
            if lines:
                self.kept[path] = sorted({**dict(self.kept.get(path, [])), **dict(lines)}.items())


def json_needles(tags: Iterable[str]) -> tuple[list[bytes], list[bytes]] | None:
    """(quoted, loose): the tags to look for between quotes in JSON lines, and the runs to look for alone (the
    tags holding a character a writer may escape); None when such a tag has no run of MIN_RUN characters."""
    quoted: list[bytes] = []
    loose: list[bytes] = []
    for tag in tags:
        if _JSON_VERBATIM.fullmatch(tag):
            quoted.append(tag.encode())
            continue
        run = max(_JSON_VERBATIM.findall(tag), key=len, default="")
        if len(run.strip()) < MIN_RUN:
            return None
        loose.append(run.encode())
    return list(dict.fromkeys(quoted)), list(dict.fromkeys(loose))


def select_lines(files: list[LogFile], conversation_id: str, tick: Tick, stats: LineStats,
                 documents: list[ClientStat]) -> Selected:
    """The lines of ``files`` the conversation's explanation needs (``documents``: the client statistics of
    files that are one JSON document, read whole by the caller). ``stats`` counts the corrupt lines of the
    first pass (the caller adds them only when the engine does not read these lines again)."""
    # (a client-statistics document is read whole by the caller)
    first = [f for f in files if f.fmt in ("events", "client_stats", "proxy") and not is_stats_document(f)]
    second = [f for f in files if f.fmt in ("vllm", "proxy", "events")]
    out = Selected(ids=[conversation_id])
    new_ids, tags = [conversation_id], set(id_tags(conversation_id))
    for round_no in range(MAX_ROUNDS):
        needles = {i: json_needles(id_tags(i)) for i in new_ids}
        if any(n is None for n in needles.values()):
            out.complete = False
            return out
        found = _parallel(first, lambda f: _conversation_lines(f, new_ids, needles, tick))  # noqa: B023
        out.add(found)
        events, client, proxy = _parse(first, found, stats)
        if round_no == 0:
            client += documents
            out.named = _names(events, client, proxy, tags)
        rids = _request_ids(events, client, proxy, {t for i in new_ids for t in id_tags(i)}) - out.request_ids
        if (round_no > 0 and not rids) or (round_no == 0 and not rids and not out.named):
            return out  # (nothing more to read; or no such conversation)
        out.request_ids |= rids
        # (engine logs are read even when no request id was found: their startup lines still say which roles
        # are present and how they are configured)
        found = _parallel(second, lambda f: _request_lines(f, sorted(rids), tick, head=round_no == 0))  # noqa: B023
        out.add(found)
        linked = _linked_ids([f for f in second if f.fmt != "vllm"], found, tags, out.request_ids)
        if not linked:
            return out
        new_ids = sorted(linked)
        out.ids += new_ids
        tags |= {t for i in new_ids for t in id_tags(i)}
        if len(out.ids) > MAX_LINKED:
            break
    out.complete = False
    return out


def _conversation_lines(f: LogFile, ids: list[str], needles: dict[str, Any], tick: Tick) -> Numbered:
    """The lines naming one of ``ids``: exact matches only ("conv=<id>:" / "<id>" in quotes), so that id c1 does
    not pull in c10..c19, but for ids a JSON writer may spell otherwise."""
    if f.fmt == "proxy":  # (and the restarts, for router_state_lost)
        tags = [t.encode() for i in ids for t in id_tags(i)]
        return list(grep_prefixed(f.path, b"conv=", tags, tick, suffix=b":", also=[b"Ready: "]))
    if f.fmt == "client_stats":
        # the benchmark client writes the ids it sent: a router's hashed tags cannot be there (one literal
        # less for rg, whose search for two literals or more takes twice as long as for one)
        needles = {i: json_needles([i]) for i in ids}
    quoted = [q for i in ids for q in needles[i][0]]
    loose = [n for i in ids for n in needles[i][1]]
    found = dict(grep_prefixed(f.path, b'"', quoted, tick, suffix=b'"'))
    if loose:
        found.update(grep_prefixed(f.path, b"", loose, tick))
    return sorted(found.items())


def _request_lines(f: LogFile, rids: list[str], tick: Tick, *, head: bool) -> Numbered:
    """The lines naming one of the request ids (and, with ``head``, an engine log's settings lines)."""
    needles = [r.encode() for r in rids]
    if f.fmt == "vllm":
        # engine lines name requests as chatcmpl-<rid>/cmpl-<rid>; settings lines sit at the start
        found = dict(head_lines(f.path, HEAD_KEYWORDS, HEAD_BYTES)) if head else {}
        found.update(grep_prefixed(f.path, b"cmpl-", needles, tick))
        return sorted(found.items())
    if f.fmt == "proxy":
        return list(grep_prefixed(f.path, b"[", needles, tick, suffix=b"]"))
    # events name the request as "request_id":"<id>" and/or an engine id "chatcmpl-<id>-<8>"
    return list(grep_prefixed(f.path, (b'"', b"cmpl-"), needles, tick))


def _parallel(files: list[LogFile], lines_for: Callable[[LogFile], Numbered]) -> dict[str, Numbered]:
    """Run the per-file prefilters (grep subprocesses, mostly) side by side; only matching lines are held. (Plain
    threads: concurrent.futures imports logging, 5 ms of the CLI's start for one conversation.)"""
    results: list[Numbered | BaseException] = [[] for _ in files]
    todo = iter(range(len(files)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = lines_for(files[i])
            except BaseException as exc:  # (raised again below, on the caller's thread)
                results[i] = exc

    workers = max(1, min(len(files), os.cpu_count() or 1, 4))
    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Numbered] = {}
    for f, got in zip(files, results, strict=True):
        if isinstance(got, (OSError, EOFError)):
            raise LogReadError(str(got)) from None
        if isinstance(got, BaseException):
            raise got
        out[f.path] = got
    return out


def _parse(files: list[LogFile], found: dict[str, Numbered], stats: LineStats
           ) -> tuple[list[EventRecord], list[ClientStat], list[Any]]:
    """Lines parsed only to learn request and conversation ids (the engine reads them again)."""
    events: list[EventRecord] = []
    client: list[ClientStat] = []
    proxy: list[Any] = []
    for f in files:
        lines = found.get(f.path, [])
        if f.fmt == "proxy":
            proxy.extend(parse_proxy_numbered(lines, f.path, stats))
            continue
        for rec in parse_json_numbered(lines, f.path, stats):
            (events if isinstance(rec, EventRecord) else client).append(rec)  # type: ignore[arg-type]
    return events, client, proxy


def _names(events: list[EventRecord], client: list[ClientStat], proxy: list[Any], tags: set[str]) -> bool:
    """True when a record belongs to the conversation (a client's turn events need no request id)."""
    return (any(ev.event.conversation_id in tags for ev in events)
            or any(stat.conversation_id in tags for stat in client)
            or any(rec.fields.get("conv") in tags for rec in proxy))


def _request_ids(events: list[EventRecord], client: list[ClientStat], proxy: list[Any], tags: set[str]
                 ) -> set[str]:
    rids: set[str] = set()
    for ev in events:
        e = ev.event
        if e.conversation_id in tags:
            rids.update(header_request_id(r) for r in (e.request_id, e.engine_request_id) if r)
    for stat in client:
        if stat.conversation_id in tags and stat.request_id:
            rids.add(stat.request_id)
    for rec in proxy:
        if rec.fields.get("conv") in tags:
            if "rid" in rec.fields:
                rids.add(rec.fields["rid"])
            if "remote" in rec.fields:
                rids.add(header_request_id(rec.fields["remote"]))
    return {r for r in rids if len(r) >= 4}  # a tiny id would match half the file


def _linked_ids(files: list[LogFile], found: dict[str, Numbered], tags: set[str], rids: set[str]) -> set[str]:
    """Conversation ids other than ``tags`` that the lines found name as the conversation of one of ``rids``
    (another conversation that only cites one, as the handle it was offered, is not linked)."""
    events, _, proxy = _parse(files, found, LineStats())
    linked = {e.event.conversation_id for e in events
              if any(r and header_request_id(r) in rids for r in (e.event.request_id, e.event.engine_request_id))}
    linked |= {rec.fields.get("conv") for rec in proxy if rec.fields.get("rid") in rids}
    return {i for i in linked if isinstance(i, str) and i and i not in tags}
