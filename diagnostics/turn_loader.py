"""The explain facade: load logs, let the verdict engine join and decide every turn, return the records.

Library entry points (report/advise read the same engine's table)::

    convs = load_turns(["demo-out/*"])                 # every conversation
    conv = explain_conversation(["demo-out/*"], "c1")  # one conversation, byte-prefiltered

One conversation is found with a byte-level prefilter (conversation_lines.py): the lines naming the
conversation (or its hashed tag), then those naming its request ids, and those of any conversation id
that names one of its requests too; only those reach the engine, which decides them exactly as it
decides every conversation (verdict_engine.py, rules.py).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import operator
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

from kvdiag.diagnostics.conversation_lines import select_lines
from kvdiag.diagnostics.detect import LogFile, LogReadError, detect, open_binary
from kvdiag.diagnostics.fix_hints import FixContext, fix_hint
from kvdiag.diagnostics.json_logs import ClientStat, parse_json_document
from kvdiag.diagnostics.linestats import LineStats
from kvdiag.diagnostics.records import ConversationRecord, ConversationSummary, Evidence, TurnRecord
from kvdiag.diagnostics.scan import grep_regex, is_events_document, is_stats_document
from kvdiag.diagnostics.sources import StagedInputs, stage_inputs
from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.verdicts import VERDICT_INFO, Confidence, Verdict

if TYPE_CHECKING:
    import pyarrow as pa

    from kvdiag.diagnostics import verdict_engine as engine

# The engine (duckdb: ~0.1 s to import; the report's turn table adds pyarrow and numpy) is imported where it
# is used, so one conversation can import it on a second thread while its greps run.

ProgressFn = Callable[[int, int], None]  # (bytes_done, bytes_total)

SOURCES: Final = ("client", "router", "prefill", "decode")


class ExplainError(KVDiagError):
    """Base class of explain errors."""


class UnreadableLogError(ExplainError):
    """A log file could not be read; the message names the file."""


class ConversationNotFoundError(ExplainError):
    """The conversation has no turn in the logs: its id appears in none of them, or (``named``) only on lines
    that make no turn; ``closest`` lists near ids."""

    def __init__(self, conversation_id: str, closest: list[str], *, named: bool = False) -> None:
        hint = f"; closest ids: {', '.join(closest)}" if closest else ""
        what = ("is named in the logs given, but on no line that makes a turn (a request, a client statistic or a "
                "turn event)") if named else "not found in the logs given"
        super().__init__(f"conversation {conversation_id!r} {what}{hint}")
        self.conversation_id = conversation_id
        self.closest = closest
        self.named = named


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
    return files


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


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    try:
        yield
    except LogReadError as exc:
        raise UnreadableLogError(str(exc)) from None
    except (OSError, EOFError) as exc:
        raise UnreadableLogError(f"cannot read a log: {exc}") from None


def run_all(files: list[LogFile], progress: ProgressFn | None = None, *, windows: bool = True,
            evidence: bool = True, config_lines: bool = False) -> engine.Run:
    """Every input through the engine, P's stats windows read where a turn waits for them (the caller
    closes ``run.con``); without ``evidence`` no turn keeps its evidence refs (the turn table reads none).
    With ``config_lines`` the vLLM and proxy logs' configuration lines are kept for advise_config.scan_config
    (report and advise read both), found by the same grep and read."""
    from kvdiag.diagnostics import verdict_engine as engine  # noqa: PLC0415
    from kvdiag.diagnostics.advise_config import MARKERS, remember_marker_lines  # noqa: PLC0415
    from kvdiag.diagnostics.engine_windows import decide_windows  # noqa: PLC0415

    run = engine.new_run(files)
    run.evidence = evidence
    if config_lines:
        run.side_needles = MARKERS
    with _reading():
        engine.load_files(run, _Progress(sum(f.size for f in files), progress, 1))
        for f, held in run.side_markers.items():
            remember_marker_lines(files[f].path, engine.marker_lines(run, f), held)
        engine.parse(run)
        engine.decide(run)
        wanted = engine.wanted_windows(run) if windows else []
        if wanted:
            decide_windows(run, wanted, one=False)
    return run


def load_turns(paths: Iterable[str] | StagedInputs, progress: ProgressFn | None = None, *,
               stats: LineStats | None = None) -> list[ConversationRecord]:
    """Every conversation in the logs (files, folders, globs, .gz and rotated files, container log wrappers,
    ``s3://`` URLs), turns classified, worst first.

    ``stats`` (optional) receives the line counts, corrupt lines skipped included.
    """
    with _decided_run(paths, progress, stats, evidence=True) as (staged, run):
        convs = records(run)
        staged.display_records(convs)
    with gc_paused():
        return sorted(convs, key=_severity)


@contextlib.contextmanager
def _decided_run(paths: Iterable[str] | StagedInputs, progress: ProgressFn | None, stats: LineStats | None, *,
                 evidence: bool) -> Iterator[tuple[StagedInputs, engine.Run]]:
    """Every input staged and through the engine; the run's line counts go to ``stats`` once it has been read."""
    with staged_inputs(paths) as staged:
        inner = LineStats()
        files = _detect(staged.paths, inner)
        run = run_all(files, progress, evidence=evidence)
        try:
            inner.merge(run.stats)
            yield staged, run
        finally:
            run.con.close()
        _merge_stats(stats, staged, inner)


def _severity(conv: ConversationRecord) -> tuple[int, int, str]:
    return conv.summary().severity


def summarize_conversations(paths: Iterable[str] | StagedInputs, progress: ProgressFn | None = None, *,
                            stats: LineStats | None = None) -> list[ConversationSummary]:
    """Every conversation's turn numbers and verdicts, worst first (what ``explain --all`` lists). No turn's
    numbers, reason or evidence are read, which takes about two thirds of the time of loading the turns."""
    with _decided_run(paths, progress, stats, evidence=False) as (_staged, run):
        rows = run.con.execute("SELECT conversation_id, list(turn ORDER BY pos), list(verdict ORDER BY pos) "
                               "FROM decided GROUP BY conversation_id").fetchall()
    summaries = [ConversationSummary(conv, tuple(turns), tuple(map(_VERDICTS.__getitem__, verdicts)))
                 for conv, turns, verdicts in rows]
    return sorted(summaries, key=operator.attrgetter("severity"))


_VERDICTS: Final = {v.value: v for v in Verdict}
_CONFIDENCE: Final = {c.value: c for c in Confidence}
_DIRECT: Final = ("turn", "request_id", "start_ts", "ttft_ms", "latency_ms", "prompt_tokens", "completion_tokens",
                  "local_hit_tokens", "remote_offered_tokens", "remote_tokens", "computed_tokens", "transfer_bytes",
                  "transfer_ms", "prefill_ms", "entry_age_s", "status", "failure_type", "prefill_request_id",
                  "decode_request_id", "model", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason",
                  "wrong_kv_tokens", "mismatch_tokens", "reason")


def records(run: engine.Run) -> list[ConversationRecord]:
    """The engine's decided turns as ConversationRecords (turns in order, fixes sharpened)."""
    from kvdiag.diagnostics import verdict_engine as engine  # noqa: PLC0415

    ctx_row = run.con.execute("SELECT ctx_has_client, ctx_has_router, ctx_has_prefill, ctx_has_decode, "
                              "ctx_decode_ttl, ctx_router_ttl FROM ctx").fetchall()[0]
    missing = [s for s, present in zip(SOURCES, ctx_row[:4], strict=True) if not present]
    fixes = FixContext(decode_ttl_s=ctx_row[4], router_ttl_s=ctx_row[5])
    if run.con.execute("SELECT count(*) FROM decided").fetchall()[0][0] > FEW_TURNS:
        table = engine.decided_rows(run)
        return records_from_table(table, engine.decided_evidence(run, table.num_rows), missing, fixes)
    cols, pairs = engine.decided_lists(run)
    with gc_paused():
        return _records(cols, [[_evidence(s, t) for s, t in items] for items in pairs], missing, fixes)


FEW_TURNS: Final = 2000  # up to this many turns, records are built without Arrow (engine.decided_lists)


def _evidence(source: str, text: str) -> Evidence:
    e: Evidence = object.__new__(Evidence)  # a frozen dataclass: its __init__ goes through object.__setattr__
    d = e.__dict__
    d["source"] = source
    d["text"] = text
    return e


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while records are built: each of its full passes would walk every
    record made so far (records hold no cycles to collect). Afterwards the objects made go straight to the
    oldest generation: the first collection would otherwise walk them all (a quarter of a second on a
    million objects); a full collection still reaches them. Only when nothing is frozen: unfreezing would
    also thaw what the host froze on purpose (before forking workers, say)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        if was:
            gc.enable()


def _evidence_lists(texts: pa.Table, at: list[int], offsets: list[int]) -> list[list[Evidence]]:
    """Each turn's Evidence objects (engine.decided_evidence): one object per line cited, made in one pass over
    the texts, then each turn's slice of the citations."""
    made = list(map(_evidence, texts.column("source").to_pylist(), texts.column("text").to_pylist()))
    cited = list(map(made.__getitem__, at))
    return [cited[a:b] for a, b in itertools.pairwise(offsets)]


def records_from_table(table: pa.Table, evidence: tuple[pa.Table, list[int], list[int]], missing: list[str],
                       fixes: FixContext) -> list[ConversationRecord]:
    """ConversationRecords from decided rows (engine.decided_rows, in conversation order) and their evidence
    (engine.decided_evidence)."""
    with gc_paused():
        cols: dict[str, list[Any]] = {name: table.column(name).to_pylist() for name in table.column_names}
        return _records(cols, _evidence_lists(*evidence), missing, fixes)


def _records(cols: dict[str, list[Any]], evidence: list[list[Evidence]], missing: list[str], fixes: FixContext
             ) -> list[ConversationRecord]:
    # Column by column (a list comprehension each), then each record's state from one row of them: a per-field
    # lookup per row costs several times more.
    gaps = [round(client, 3) if gap is None and prev is not None and client is not None else gap
            for gap, prev, client in zip(cols["ev_gap_s"], cols["prev_sid"], cols["client_gap"], strict=True)]
    ends = [start + latency / 1000.0 if start is not None and latency is not None else None
            for start, latency in zip(cols["start_ts"], cols["latency_ms"], strict=True)]
    verdicts = [_VERDICTS[v] for v in cols["verdict"]]
    direct = ([r or "" for r in cols[name]] if name == "reason" else cols[name] for name in _DIRECT)
    values = [cols["conversation_id"], *direct, gaps, ends, verdicts, [_CONFIDENCE[c] for c in cols["confidence"]],
              [VERDICT_INFO[v].fix for v in verdicts], evidence]
    out: list[ConversationRecord] = []
    conv: ConversationRecord | None = None
    new = object.__new__
    for state in map(dict, map(zip, itertools.repeat(_STATE), zip(*values, strict=True))):
        conv_id = state["conversation_id"]
        if conv is None or conv.conversation_id != conv_id:
            conv = ConversationRecord(conversation_id=conv_id, missing_sources=list(missing))
            out.append(conv)
        rec: TurnRecord = new(TurnRecord)
        rec.__dict__ = state  # (a dataclass without __slots__: its fields live in __dict__)
        fix_hint(rec, fixes)
        conv.turns.append(rec)
    return out


# A record's state in the order the columns above give it.
_STATE: Final = ("conversation_id", *_DIRECT, "gap_s", "end_ts", "verdict", "confidence", "fix", "evidence")


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
    # The collector stays off for the whole run: its passes would walk the modules being imported and the
    # run's few objects again and again (about 2% of the CLI's CPU), and a run this small leaves little garbage.
    with gc_paused():
        files = _detect(paths, stats)
        # The engine is imported and its run opened on a second thread while the greps below run (they wait on
        # rg or grep, not on Python), so neither costs wall time of its own.
        prepared = _PreparedRun(files, conversation_id)
        try:
            return _explain_prefiltered(files, conversation_id, progress, prepared, stats=stats)
        finally:
            prepared.close()


class _PreparedRun:
    """The engine's run over ``files``, opened on a second thread."""

    def __init__(self, files: list[LogFile], only: str) -> None:
        self.files, self.only = files, only
        self.run: engine.Run | None = None
        self.thread = threading.Thread(target=self._open, name="kvdiag-engine-open", daemon=True)
        self.thread.start()

    def _open(self) -> None:
        with contextlib.suppress(Exception):  # (a failure is raised again where the run is taken)
            self.run = importlib.import_module("kvdiag.diagnostics.verdict_engine").new_run(self.files, self.only)

    def take(self) -> engine.Run:
        """The run (opened here if the thread could not); the caller closes it."""
        self.thread.join()
        run, self.run = self.run, None
        if run is None:
            from kvdiag.diagnostics import verdict_engine as engine  # noqa: PLC0415

            run = engine.new_run(self.files, self.only)
        return run

    def close(self) -> None:
        """Close the run if nobody took it."""
        self.thread.join()
        if self.run is not None:
            self.run.con.close()
            self.run = None


def _explain_prefiltered(files: list[LogFile], conversation_id: str, progress: ProgressFn | None,
                         prepared: _PreparedRun, *, stats: LineStats) -> ConversationRecord:
    if any(is_events_document(f) for f in files):  # (its lines naming the conversation are no whole records)
        prepared.close()
        return _explain_from_every_line(files, conversation_id, progress, stats)
    tick = _Progress(sum(f.size for f in files), progress, 2)
    documents = [f for f in files if is_stats_document(f)]
    first_stats = LineStats()
    with _reading():
        stats_documents = [s for f in documents for s in _document_stats(f)]
        sel = select_lines(files, conversation_id, tick, first_stats, stats_documents)
    if not sel.complete:  # (links past the prefilter's bounds: every line is read, as explain --all reads them)
        prepared.close()
        return _explain_from_every_line(files, conversation_id, progress, stats)
    if not sel.request_ids and not sel.named:
        stats.merge(first_stats)  # (the engine reads none of these lines: their corrupt ones are counted here)
        raise ConversationNotFoundError(conversation_id, closest_ids(files, conversation_id))
    from kvdiag.diagnostics import verdict_engine as engine  # noqa: PLC0415
    from kvdiag.diagnostics.engine_json_records import add_document  # noqa: PLC0415

    if len(sel.ids) == 1:
        run = prepared.take()
    else:  # (linked conversations: each one's turns are placed as explain --all places them)
        prepared.close()
        run = engine.new_run(files, None)
    try:
        if not documents and sum(map(len, sel.kept.values())) <= FEW_LINES:
            engine.use_few_rows(run)
        with _reading():
            for f, lf in enumerate(files):
                if lf.fmt == "unknown":
                    run.stats.unrecognised_files.append(lf.path)
                elif lf in documents:
                    add_document(run, f)
                elif lf.path in sel.kept:
                    engine.add_lines(run, f, sel.kept[lf.path])
            engine.parse(run)
            engine.decide(run)
            wanted = engine.wanted_windows(run)
            if wanted:  # (most conversations need no stats window: their reader is imported only here)
                from kvdiag.diagnostics.engine_windows import decide_windows  # noqa: PLC0415

                decide_windows(run, wanted, one=True)
            stats.merge(run.stats)
            convs = [c for c in records(run) if c.conversation_id == conversation_id]
    finally:
        run.con.close()
    if not convs:  # (named, but on no line that makes a turn: a stale-entry line alone, say)
        raise ConversationNotFoundError(conversation_id, closest_ids(files, conversation_id), named=True)
    return convs[0]


def _explain_from_every_line(files: list[LogFile], conversation_id: str, progress: ProgressFn | None,
                             stats: LineStats) -> ConversationRecord:
    run = run_all(files, progress)
    try:
        stats.merge(run.stats)
        convs = [c for c in records(run) if c.conversation_id == conversation_id]
    finally:
        run.con.close()
    if not convs:
        raise ConversationNotFoundError(conversation_id, closest_ids(files, conversation_id))
    return convs[0]


FEW_LINES: Final = 5000  # up to this many prefiltered lines, one conversation's statements run unoptimized


def _document_stats(f: LogFile) -> list[ClientStat]:
    try:
        with open_binary(f.path) as fh:
            return list(parse_json_document(fh.read(), f.path))
    except (OSError, EOFError) as exc:
        raise UnreadableLogError(f"cannot read {f.path}: {exc}") from None


def closest_ids(files: list[LogFile], conversation_id: str, limit: int = 5) -> list[str]:
    """Conversation ids seen in the client/router/proxy logs that look most like ``conversation_id`` (never the
    id itself: a conversation named on lines that make no turn is still not found)."""
    import difflib  # noqa: PLC0415 - only for an id not found
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
    seen.discard(conversation_id)
    return difflib.get_close_matches(conversation_id, sorted(seen), n=limit, cutoff=0.3)


__all__ = ["ClientStat", "ConversationNotFoundError", "ExplainError", "LineStats", "UnreadableLogError",
           "closest_ids", "explain_conversation", "load_turns", "records", "run_all"]
