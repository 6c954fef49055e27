"""The explain facade: load logs, correlate them by ids and classify every turn.

Library entry points (report/advise call these)::

    convs = load_turns(["demo-out/*"])                 # every conversation
    conv = explain_conversation(["demo-out/*"], "c1")  # one conversation, byte-prefiltered

One conversation is found with a byte-level prefilter (scan.py): first the lines naming the
conversation (or its hashed tag), then the lines naming its request ids; only those are parsed.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from kvdiag.diagnostics.classify import Context, classify_turn
from kvdiag.diagnostics.correlate import Conversation, LogIndex, correlate, id_tags
from kvdiag.diagnostics.detect import LogFile, LogReadError, detect, open_binary
from kvdiag.diagnostics.json_logs import ClientStat, EventRecord, parse_json_document, parse_json_numbered
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.proxy_log import parse_proxy_numbered
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.scan import grep_lines, grep_prefixed, grep_regex, head_lines, read_all_lines
from kvdiag.diagnostics.sources import StagedInputs, stage_inputs
from kvdiag.diagnostics.vllm_log import header_request_id, parse_vllm_numbered
from kvdiag.diagnostics.window_load import ledger_for_conversation, ledger_for_index
from kvdiag.schema.verdicts import VERDICT_INFO, Verdict

ProgressFn = Callable[[int, int], None]  # (bytes_done, bytes_total)

# Only lines with one of these texts matter in a vLLM log: a literal prefilter skips the rest (stats,
# access logs, model loading) at C speed. Keep in step with vllm_log._CLASSIFIERS.
VLLM_KEYWORDS: Final = (
    b"Declining expired", b"Releasing expired", b"Potentially invalid KV", b"NIXL transfer failure",
    b"due to KV load failure", b"Recovered from KV load", b"Skipping KV post", b"Skipping remote pull",
    b"get_num_new_matched_tokens", b"start_load_kv for", b"calling _read_blocks", b"Finished recving",
    b"WAITING_FOR_REMOTE_KVS", b"Got invalid KVTransferParams", b"Bidirectional KV transfer is enabled",
    b"Generated response", b"Aborted request", b"aborted.", b") failed", b" failed.", b"Received request",
    b"NIXLConnector request_finished(", b"Finished sending", b"Added request", b"but no KVConnector found",
    b" failed (", b" failed with an internal error",
)
HEAD_KEYWORDS: Final = (b"Bidirectional KV transfer is enabled", b"remote block size")
HEAD_BYTES: Final = 4 * 1024 * 1024  # engine settings are logged at startup
SOURCES: Final = ("client", "router", "prefill", "decode")


class ExplainError(Exception):
    """Base class of explain errors."""


class UnreadableLogError(ExplainError):
    """A log file could not be read; the message names the file."""


class ConversationNotFoundError(ExplainError):
    """The conversation id appears in none of the logs; ``closest`` lists near ids."""

    def __init__(self, conversation_id: str, closest: list[str]) -> None:
        hint = f"; closest ids: {', '.join(closest)}" if closest else ""
        super().__init__(f"conversation {conversation_id!r} not found in the logs given{hint}")
        self.conversation_id = conversation_id
        self.closest = closest


class _Progress:
    def __init__(self, total: int, fn: ProgressFn | None, passes: int) -> None:
        self.total, self.fn, self.done = total * passes, fn, 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(min(self.done, self.total), self.total)


def _detect(paths: Iterable[str], stats: LineStats) -> list[LogFile]:
    try:
        files = detect(paths)
    except LogReadError as exc:
        raise UnreadableLogError(str(exc)) from None
    # Files no parser recognises are skipped, and named so the operator knows they were not read.
    stats.unrecognised_files.extend(f.path for f in files if f.fmt == "unknown")
    return files


def _parse(index: LogIndex, f: LogFile, numbered: Iterable[tuple[int, bytes]]) -> None:
    stats = LineStats()
    if f.fmt == "vllm":
        index.vllm.extend(parse_vllm_numbered(numbered, f.path, stats))
    elif f.fmt == "proxy":
        index.proxy.extend(parse_proxy_numbered(numbered, f.path, stats))
    elif f.fmt in ("events", "client_stats"):
        for rec in parse_json_numbered(numbered, f.path, stats):
            if isinstance(rec, EventRecord):
                index.events.append(rec)
            else:
                index.client.append(rec)
    index.stats.merge(stats)


def is_json_document(f: LogFile) -> bool:
    """True for a client-statistics file that is one JSON document (an array), not JSON lines."""
    if f.fmt != "client_stats":
        return False
    with open_binary(f.path) as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def _load(files: list[LogFile], index: LogIndex, lines_for: Callable[[LogFile], Iterator[tuple[int, bytes]]]
          ) -> None:
    for f in files:
        index.formats[f.path] = f.fmt
        index.file_roles.setdefault(f.path, f.role)
        try:
            if is_json_document(f):
                with open_binary(f.path) as fh:
                    index.client.extend(parse_json_document(fh.read(), f.path, index.stats))
                continue
            _parse(index, f, lines_for(f))
        except LogReadError as exc:
            raise UnreadableLogError(str(exc)) from None
        except (OSError, EOFError) as exc:
            raise UnreadableLogError(f"cannot read {f.path}: {exc}") from None


def load_index(paths: Iterable[str], progress: ProgressFn | None = None) -> LogIndex:
    """Parse every input (vLLM logs through the keyword prefilter)."""
    index = LogIndex()
    files = _detect(paths, index.stats)
    tick = _Progress(sum(f.size for f in files), progress, 1)
    engine_logs = [f for f in files if f.fmt == "vllm"]

    def prefilter(f: LogFile) -> list[tuple[int, bytes]]:
        return list(grep_lines(f.path, VLLM_KEYWORDS, tick))

    # The engine logs' keyword prefilter (grep children, mostly) starts first and runs on the other
    # core while this thread parses the JSON and proxy files; parsing stays in file order.
    with ThreadPoolExecutor(max_workers=max(1, min(len(engine_logs), 4))) as pool:
        kept = {f.path: pool.submit(prefilter, f) for f in engine_logs}

        def lines_for(f: LogFile) -> Iterator[tuple[int, bytes]]:
            if f.fmt == "vllm":
                return iter(kept[f.path].result())
            if f.fmt == "unknown":
                tick(f.size)
                return iter(())
            return read_all_lines(f.path, tick)

        _load(files, index, lines_for)
    return index


def classify(conv: Conversation, index: LogIndex, ctx: Context | None = None) -> ConversationRecord:
    """Classify a correlated conversation's turns; list the log sources that were missing."""
    ctx = ctx or Context.from_index(index)
    out = ConversationRecord(conversation_id=conv.conversation_id)
    for i, facts in enumerate(conv.turns):
        out.turns.append(classify_turn(facts, conv.turns[:i], ctx))
    present = {"client": ctx.has_client, "router": ctx.has_router, "prefill": ctx.has_prefill,
               "decode": ctx.has_decode}
    out.missing_sources = [s for s in SOURCES if not present[s]]
    return out


def _severity(conv: ConversationRecord) -> tuple[int, int, str]:
    bad = sum(1 for t in conv.turns if t.verdict in VERDICT_INFO and VERDICT_INFO[t.verdict].eligible
              and not VERDICT_INFO[t.verdict].reused)
    unknown = sum(1 for t in conv.turns if t.verdict is Verdict.UNKNOWN)
    return (-bad, -unknown, conv.conversation_id)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Suspend the cyclic garbage collector while millions of (acyclic) records are built.

    Why: each generation-2 pass walks every live record, and they only grow while logs load; the
    collector cost a third of ``explain --all`` over 1 GB (BENCHMARKS.md). Nothing here makes cycles
    that must be freed early; the collector resumes (as it was) on exit, errors included.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def staged_inputs(paths: Iterable[str] | StagedInputs) -> Iterator[StagedInputs]:
    """``paths`` made local and bare (sources.stage_inputs), errors as UnreadableLogError naming the input."""
    if isinstance(paths, StagedInputs):
        yield paths
        return
    try:
        ctx = stage_inputs(list(paths))
        staged = ctx.__enter__()
    except LogReadError as exc:
        raise UnreadableLogError(str(exc)) from None
    try:
        yield staged
    except (UnreadableLogError, LogReadError) as exc:  # a wrapped input is unwrapped on first use
        raise UnreadableLogError(staged.display(str(exc))) from None
    finally:
        ctx.__exit__(None, None, None)


def _merge_stats(stats: LineStats | None, staged: StagedInputs, inner: LineStats) -> None:
    if stats is None:
        return
    staged.display_stats(inner)
    stats.merge(staged.stats)
    stats.merge(inner)


def load_turns(paths: Iterable[str] | StagedInputs, progress: ProgressFn | None = None, *,
               stats: LineStats | None = None) -> list[ConversationRecord]:
    """Every conversation in the logs (files, folders, globs, .gz and rotated files, container log wrappers,
    ``s3://`` URLs), turns classified, worst first.

    ``stats`` (optional) receives the line counts, corrupt lines skipped included.
    """
    with staged_inputs(paths) as staged:
        inner = LineStats()
        convs = _load_turns(staged.paths, progress, stats=inner)
        staged.display_records(convs)
        _merge_stats(stats, staged, inner)
        return convs


def _load_turns(paths: Iterable[str], progress: ProgressFn | None, *, stats: LineStats) -> list[ConversationRecord]:
    with gc_paused():
        index = load_index(paths, progress)
        stats.merge(index.stats)
        ctx = Context.from_index(index)
        joined = correlate(index)
        convs = [classify(c, index, ctx) for c in joined]
        if ctx.window_wanted:  # turns only P's stats windows can decide: read them, classify those again
            wanted = set(ctx.window_wanted)
            ctx.windows = ledger_for_index(index)
            if ctx.windows is not None:
                for i, conv in enumerate(joined):
                    if any(t.proxy is not None and t.proxy.rid in wanted for t in conv.turns):
                        convs[i] = classify(conv, index, ctx)
        return sorted(convs, key=_severity)


def explain_conversation(paths: Iterable[str] | StagedInputs, conversation_id: str,
                         progress: ProgressFn | None = None, *, stats: LineStats | None = None) -> ConversationRecord:
    """One conversation, its turns classified; raise ConversationNotFoundError if absent.

    ``stats`` (optional) receives the counts of the lines the prefilter kept (corrupt ones included).
    """
    with staged_inputs(paths) as staged:
        inner = LineStats()
        try:
            conv = _explain_conversation(staged.paths, conversation_id, progress, stats=inner)
        finally:
            _merge_stats(stats, staged, inner)
        staged.display_records([conv])
        return conv


def _explain_conversation(paths: Iterable[str], conversation_id: str, progress: ProgressFn | None, *,
                          stats: LineStats) -> ConversationRecord:
    index = LogIndex()
    files = _detect(paths, stats)
    tick = _Progress(sum(f.size for f in files), progress, 2)
    tags = id_tags(conversation_id)
    # JSON writers escape non-ASCII and quotes: look for that spelling too
    json_tags = [t.encode() for t in dict.fromkeys(tags + [json.dumps(t)[1:-1] for t in tags])]

    def first_lines(f: LogFile) -> Iterable[tuple[int, bytes]]:
        # exact matches only ("conv=<id>:" / "<id>" in quotes): id c1 must not pull in c10..c19
        if f.fmt != "proxy":
            return grep_prefixed(f.path, b'"', json_tags, tick, suffix=b'"')
        found = dict(grep_prefixed(f.path, b"conv=", [t.encode() for t in tags], tick, suffix=b":"))
        found.update(grep_lines(f.path, [b"Ready: "]))  # restarts, for router_state_lost
        return sorted(found.items())

    # Pass 1: the lines naming the conversation (client, router, proxy, events).
    first = [f for f in files if f.fmt in ("events", "client_stats", "proxy")]
    _load(first, index, _parallel(first, first_lines))
    rids = _request_ids(index, conversation_id)
    if not rids and not any(c.conversation_id == conversation_id for c in index.client):
        raise ConversationNotFoundError(conversation_id, closest_ids(files, conversation_id))
    # Pass 2: the lines naming its request ids (engine logs, rid-only proxy lines, engine events).
    rid_needles = sorted({r.encode() for r in rids})
    seen_lines = {(e.path, e.lineno) for e in index.events} | {(p.path, p.lineno) for p in index.proxy}

    def second_lines(f: LogFile) -> Iterator[tuple[int, bytes]]:
        if f.fmt == "vllm":
            # engine lines name requests as chatcmpl-<rid>/cmpl-<rid>; settings lines sit at the start
            found = dict(head_lines(f.path, HEAD_KEYWORDS, HEAD_BYTES))
            found.update(grep_prefixed(f.path, b"cmpl-", rid_needles, tick))
            lines: Iterable[tuple[int, bytes]] = sorted(found.items())
        elif f.fmt == "proxy":
            lines = grep_prefixed(f.path, b"[", rid_needles, tick, suffix=b"]")
        else:  # events name the request as "request_id":"<id>" and/or an engine id "chatcmpl-<id>-<8>"
            found = dict(grep_prefixed(f.path, b'"', rid_needles, tick))
            found.update(grep_prefixed(f.path, b"cmpl-", rid_needles))
            lines = sorted(found.items())
        for lineno, line in lines:
            if (f.path, lineno) not in seen_lines:
                yield lineno, line

    second_files = [f for f in files if f.fmt == "vllm" or (f.fmt in ("proxy", "events")
                                                           and _needs_second_pass(f, index, rids))]
    # Engine logs are loaded even when no request id was found: their startup lines still say which
    # roles are present and how they are configured.
    _load(second_files, index, _parallel(second_files, second_lines))
    # back into file order (rotated files oldest first, as detect() sorted them), then line order
    order = {f.path: i for i, f in enumerate(files)}
    index.proxy.sort(key=lambda p: (order[p.path], p.lineno))
    index.events.sort(key=lambda e: (order[e.path], e.lineno))
    convs = correlate(index, only=conversation_id)
    # A second look at the ids of engine/proxy lines only joined through rids is not needed:
    # correlate keys every record by the rids gathered in pass 1.
    stats.merge(index.stats)
    match = next((c for c in convs if c.conversation_id == conversation_id), None)
    if match is None:
        raise ConversationNotFoundError(conversation_id, closest_ids(files, conversation_id))
    ctx = Context.from_index(index)
    out = classify(match, index, ctx)
    if ctx.window_wanted:  # turns only P's stats windows can decide: read the minutes around them
        try:
            ctx.windows = ledger_for_conversation(files, index, ctx.window_wanted)
        except (LogReadError, OSError, EOFError) as exc:
            raise UnreadableLogError(str(exc)) from None
        if ctx.windows is not None:
            out = classify(match, index, ctx)
    return out


def _parallel(files: list[LogFile], lines_for: Callable[[LogFile], Iterable[tuple[int, bytes]]]
              ) -> Callable[[LogFile], Iterator[tuple[int, bytes]]]:
    """Run the per-file prefilters (grep subprocesses, mostly) side by side; parse in file order after.

    Only the matching lines are held, so memory stays small; threads wait on the children's pipes.
    """
    def collect(f: LogFile) -> list[tuple[int, bytes]]:
        return list(lines_for(f))

    workers = max(1, min(len(files), os.cpu_count() or 1, 4))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {f.path: pool.submit(collect, f) for f in files}
        try:
            done = {path: fut.result() for path, fut in futures.items()}
        except (LogReadError, OSError, EOFError) as exc:
            raise UnreadableLogError(str(exc)) from None
    return lambda f: iter(done.get(f.path, []))


def _needs_second_pass(f: LogFile, index: LogIndex, rids: set[str]) -> bool:
    """Skip re-reading a file whose lines for this conversation pass 1 already has.

    Client events all carry the conversation; router events too, unless a turn went without a
    conversation_id (then its router event is only reachable through the request id); the proxy's
    request-only lines ("Prefill done") add nothing when router events cover every request.
    """
    sources = {e.event.source for e in index.events if e.path == f.path}
    # only router events that decide their turn (stock rules, which need every proxy line, never run for them)
    router_rids = {e.event.request_id for e in index.events if e.event.source == "router" and e.event.request_id
                   and e.event.outcome not in (None, Verdict.UNKNOWN.value)}
    covered = bool(router_rids) and rids <= router_rids
    if f.fmt == "events":
        if sources == {"client"}:
            return False
        if sources == {"router"}:
            return not covered
        return True
    return not covered  # proxy


def _request_ids(index: LogIndex, conversation_id: str) -> set[str]:
    tags = set(id_tags(conversation_id))
    rids: set[str] = set()
    for ev in index.events:
        e = ev.event
        if e.conversation_id in tags:
            rids.update(header_request_id(r) for r in (e.request_id, e.engine_request_id) if r)
    for stat in index.client:
        if stat.conversation_id == conversation_id and stat.request_id:
            rids.add(stat.request_id)
    for rec in index.proxy:
        if rec.fields.get("conv") in tags:
            if "rid" in rec.fields:
                rids.add(rec.fields["rid"])
            if "remote" in rec.fields:
                rids.add(header_request_id(rec.fields["remote"]))
    return {r for r in rids if len(r) >= 4}  # a tiny id would match half the file


def closest_ids(files: list[LogFile], conversation_id: str, limit: int = 5) -> list[str]:
    """Conversation ids seen in the client/router/proxy logs that look most like ``conversation_id``."""
    pattern = re.compile(rb'"conversation_id": ?"([^"]{1,200})"|conv=([^\s:]{1,200})')
    seen: set[str] = set()
    for f in files:
        if f.fmt not in ("events", "client_stats", "proxy"):
            continue
        try:
            for _, line in grep_regex(f.path, pattern):
                for m in pattern.finditer(line):
                    seen.add((m.group(1) or m.group(2)).decode("utf-8", errors="replace"))
                if len(seen) > 100_000:
                    break
        except LogReadError:
            continue
    return difflib.get_close_matches(conversation_id, sorted(seen), n=limit, cutoff=0.3)


__all__ = ["ClientStat", "ConversationNotFoundError", "ExplainError", "LineStats", "UnreadableLogError", "classify",
           "closest_ids", "explain_conversation", "load_index", "load_turns"]
