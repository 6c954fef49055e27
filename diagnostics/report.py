"""`kvdiag report`: the per-turn table and its aggregations (outcome mix, TTFT, transfers, gaps).

Library first: :func:`load_turn_table` gives one pandas row per turn (:func:`build_turn_table` the same from
ConversationRecords); every section of the report is a pure function of that table (report_sections), so the
CLI, the HTML report and the JSON document share it. The CLI keeps the table in Arrow and never imports pandas
(which would double its start-up). Buckets come from kvdiag.schema.metrics (same labels as metrics).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import duckdb
import numpy as np
import pyarrow as pa

from kvdiag.diagnostics import report_cache
from kvdiag.diagnostics.detect import LogReadError, detect
from kvdiag.diagnostics.records import ConversationRecord
from kvdiag.diagnostics.report_sections import (
    GapSummary,
    Section,
    SectionFrame,
    TurnTable,
    first_later_section,
    outcome_mix_section,
    summarize_gaps,
    totals,
    transfer_section,
    ttft_section,
)
from kvdiag.diagnostics.report_trims import TrimSummary, trim_summary
from kvdiag.diagnostics.sources import StagedInputs, stage_inputs
from kvdiag.diagnostics.turn_loader import UnreadableLogError, run_all
from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.metrics import _PROMPT_EDGES, MISSING_METADATA_REASONS, PROMPT_BUCKETS
from kvdiag.schema.verdicts import ELIGIBLE_VERDICTS, REUSED_VERDICTS, Verdict

if TYPE_CHECKING:
    import pandas as pd

    from kvdiag.diagnostics.verdict_engine import Run

# The turn table as the library gives it (pandas) or as the CLI keeps it (Arrow); every report function takes both.
TurnData: TypeAlias = "pd.DataFrame | pa.Table"

# Bump when the table's columns (or how a path fills them) change: it is part of the Parquet cache key.
# 2: the DuckDB path's reasons, confidence, statuses and unknown gaps now equal the parser's.
# 3: stock INFO turns decided by P's stats windows; TTFT and tokens client first; answered turns after a
#    failed P attempt.
# 4: partial reuse (handle, reuse limit, trimmed tokens and why) and P's wrong-KV and mismatch counts.
# 5: one verdict engine for every input (stock logs alone included).
TABLE_VERSION: Final = 5

TABLE_COLUMNS: Final = (
    "conversation_id", "turn", "turn_bucket", "prompt_tokens", "prompt_bucket", "verdict", "reused",
    "eligible", "confidence", "request_id", "start_ts", "end_ts", "ttft_ms", "latency_ms",
    "completion_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_tokens", "computed_tokens",
    "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s", "status", "failure_type",
    "metadata_reason", "model", "handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason",
    "wrong_kv_tokens", "mismatch_tokens", "reason",
)
_FLOAT_COLUMNS: Final = ("start_ts", "end_ts", "ttft_ms", "latency_ms", "transfer_ms", "prefill_ms", "gap_s",
                         "entry_age_s")
_INT_COLUMNS: Final = ("turn", "prompt_tokens", "completion_tokens", "local_hit_tokens", "remote_offered_tokens",
                       "remote_tokens", "computed_tokens", "transfer_bytes", "handle_tokens", "reuse_limit_tokens",
                       "trimmed_tokens", "wrong_kv_tokens", "mismatch_tokens")
_STR_COLUMNS: Final = ("conversation_id", "turn_bucket", "prompt_bucket", "verdict", "confidence", "request_id",
                       "status", "failure_type", "metadata_reason", "model", "trim_reason", "reason")

_TRIM_COLUMNS: Final = ("handle_tokens", "reuse_limit_tokens", "trimmed_tokens", "trim_reason", "wrong_kv_tokens",
                        "mismatch_tokens")


class ReportError(KVDiagError):
    """The inputs cannot produce a report (no turns, unreadable cache); the message says why."""


# The turn's own columns (a TurnRecord's, or the engine's decided row); the rest of TABLE_COLUMNS is derived
# from them by DERIVE_SQL, the same for both.
RAW_COLUMNS: Final = (
    "conversation_id", "turn", "pos", "prompt_tokens", "verdict", "confidence", "request_id", "start_ts", "end_ts",
    "ttft_ms", "latency_ms", "completion_tokens", "local_hit_tokens", "remote_offered_tokens", "remote_tokens",
    "computed_tokens", "transfer_bytes", "transfer_ms", "prefill_ms", "gap_s", "entry_age_s", "status", "failure_type",
    "model", *_TRIM_COLUMNS, "reason")


def _in(verdicts: frozenset[Verdict]) -> str:
    return ", ".join(f"'{v.value}'" for v in sorted(verdicts))


def derive_sql(source: str, key: str | None = None, prev: str | None = None) -> str:
    """TABLE_COLUMNS from RAW_COLUMNS rows in ``source``: the buckets, the reuse flags, the missing-metadata
    cause named in the reason, an end from start and latency, and a gap from the previous turn's end. With
    ``key`` (a column unique per row), the previous turn's end is found on narrow rows and joined back by it;
    with ``prev`` too (a column holding the previous turn's ``key``), by a join on it instead of a window."""
    edges = " ".join(f"WHEN prompt_tokens < {e} THEN '{b}'" for e, b in zip(_PROMPT_EDGES, PROMPT_BUCKETS,
                                                                                strict=False))
    reasons = " ".join(f"WHEN contains(reason, '{n}') THEN '{n}'" for n in MISSING_METADATA_REASONS)
    end = "coalesce(end_ts, start_ts + latency_ms / 1000.0)"
    # the time since the previous turn's end, computed once in a subquery (named twice in gap_s, the window took
    # twice the wall time)
    since = "since_prev"
    window = f"start_ts - lag({end}) OVER (PARTITION BY conversation_id ORDER BY turn, pos) AS since_prev"
    # (the window sorting the wide rows, their reasons included, costs more than a join on the key)
    rows = (f"(SELECT *, {window} FROM {source})" if key is None
            else f"(SELECT * FROM {source} JOIN (SELECT {key}, {window} FROM {source}) USING ({key}))" if prev is None
            # (a hash join on the key the engine gives costs less than the window's sort by conversation)
            else f"""(SELECT s.*, s.start_ts - p.prev_end AS since_prev FROM {source} s LEFT JOIN
                      (SELECT {key} AS prev_key, {end} AS prev_end FROM {source}) p ON p.prev_key = s.{prev})""")
    cols = {
        "turn_bucket": "CASE WHEN turn <= 1 THEN '1' WHEN turn = 2 THEN '2' WHEN turn = 3 THEN '3' WHEN turn <= 7 "
                       "THEN '4-7' ELSE '8+' END",
        "prompt_bucket": f"CASE WHEN prompt_tokens IS NULL THEN NULL {edges} ELSE '{PROMPT_BUCKETS[-1]}' END",
        "reused": f"verdict IN ({_in(REUSED_VERDICTS)})", "eligible": f"verdict IN ({_in(ELIGIBLE_VERDICTS)})",
        "end_ts": end,
        "gap_s": f"coalesce(gap_s, CASE WHEN turn > 1 THEN CASE WHEN {since} < 0 THEN 0.0 ELSE {since} END END)",
        "metadata_reason": f"CASE WHEN verdict <> '{Verdict.METADATA_NOT_RETURNED.value}' THEN NULL {reasons} "
                           "ELSE 'unknown' END",
        "reason": "coalesce(reason, '')",
    }
    select = ", ".join(f"{cols[c]} AS {c}" if c in cols else c for c in TABLE_COLUMNS)
    return f"SELECT {select} FROM {rows} ORDER BY conversation_id, turn, pos"


def _derive(con: duckdb.DuckDBPyConnection, source: str, key: str | None = None, prev: str | None = None
            ) -> pa.Table:
    return con.sql(derive_sql(source, key, prev)).to_arrow_table()


def table_frame(table: pa.Table) -> pd.DataFrame:
    """The turn table as pandas, with the stable dtypes of :func:`normalize_table`."""
    import pandas as pd  # noqa: PLC0415 - the terminal report runs without pandas

    # nullable integers straight from Arrow (no float round trip for normalize_table to undo)
    return normalize_table(table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get))


def as_frame(table: TurnData) -> pd.DataFrame:
    """``table`` as pandas (a DataFrame is returned as it is)."""
    return table_frame(table) if isinstance(table, pa.Table) else table


def build_turn_table(conversations: Iterable[ConversationRecord]) -> pd.DataFrame:
    """Return one row per turn (columns TABLE_COLUMNS), with gaps filled from start/end times."""
    cols: dict[str, list[Any]] = {name: [] for name in RAW_COLUMNS}
    for conv in conversations:
        for pos, t in enumerate(conv.turns):
            state = t.__dict__
            for name in RAW_COLUMNS:
                cols[name].append(pos if name == "pos" else state[name])
            cols["conversation_id"][-1] = conv.conversation_id
            cols["verdict"][-1] = Verdict(t.verdict).value
            cols["confidence"][-1] = str(t.confidence)
    types = {c: pa.float64() for c in _FLOAT_COLUMNS} | {c: pa.int64() for c in _INT_COLUMNS} | {"pos": pa.int64()}
    raw = pa.table({c: pa.array(v, type=types.get(c, pa.string())) for c, v in cols.items()})
    con = duckdb.connect()
    try:
        con.register("raw_turns", raw)
        return table_frame(_derive(con, "raw_turns"))
    finally:
        con.close()


def _check_columns(names: Iterable[str]) -> None:
    missing = sorted(set(TABLE_COLUMNS) - set(names), key=TABLE_COLUMNS.index)
    if missing:
        raise ReportError(f"turn table lacks column(s) {', '.join(missing)}; rebuild it (delete the cache)")


def normalize_table(df: pd.DataFrame) -> pd.DataFrame:
    """Give the table stable dtypes (nullable ints, floats, strings) whatever its origin."""
    import pandas as pd  # noqa: PLC0415

    _check_columns(df.columns)
    # Column by column, and only where the dtype differs: on a million-row table a blanket copy costs
    # more than the aggregations.
    # Already in order (the engine's table): a shallow copy, so a converted column never touches df.
    out = df.copy(deep=False) if list(df.columns) == list(TABLE_COLUMNS) else df.loc[:, list(TABLE_COLUMNS)]
    for cols, dtype in ((_FLOAT_COLUMNS, "float64"), (_INT_COLUMNS, "Int64"), (_STR_COLUMNS, "str"),
                        (("reused", "eligible"), "bool")):
        for c in cols:
            if str(out[c].dtype) == dtype:
                continue
            if dtype in ("float64", "Int64"):
                out[c] = pd.to_numeric(out[c], errors="coerce").astype(dtype)
            else:
                out[c] = out[c].astype(dtype)
    return out


@dataclass
class Report:
    """Everything `kvdiag report` prints and writes, computed from one turn table. The sections are small
    tables (report_sections.Section); ``by_turn``, ``ttft`` and the others give them as DataFrames."""

    table: TurnData
    turns: int
    conversations: int
    outcome_by_turn: Section
    outcome_by_prompt: Section
    ttft_by_prompt: Section
    transfer_by_prompt: Section
    first_vs_later: Section
    gaps: GapSummary
    trims: TrimSummary

    # the sections as DataFrames (what library users index with .loc)
    by_turn = SectionFrame("outcome_by_turn")
    by_prompt = SectionFrame("outcome_by_prompt")
    ttft = SectionFrame("ttft_by_prompt")
    transfer = SectionFrame("transfer_by_prompt")
    first_later = SectionFrame("first_vs_later")

    @property
    def sections(self) -> list[tuple[str, Section]]:
        """The titled tables, in print order."""
        return [
            ("Outcome mix by turn index", self.outcome_by_turn),
            ("Outcome mix by prompt length (tokens)", self.outcome_by_prompt),
            ("TTFT of later turns: reused vs recomputed (ms)", self.ttft_by_prompt),
            ("D→P transfers by prompt length", self.transfer_by_prompt),
            ("First turn vs later turns", self.first_vs_later),
            ("Partial reuse: D's tokens trimmed, by reason", self.trims.reasons),
        ]

    def to_json_dict(self) -> dict[str, Any]:
        """The report --json document (see docs/report.md)."""
        return {
            "turns": self.turns,
            "conversations": self.conversations,
            "outcome_by_turn": self.outcome_by_turn.records(),
            "outcome_by_prompt": self.outcome_by_prompt.records(),
            "ttft_by_prompt": self.ttft_by_prompt.records(),
            "transfer_by_prompt": self.transfer_by_prompt.records(),
            "first_vs_later": self.first_vs_later.records(),
            "gaps": self.gaps.to_json_dict(),
            "trims": self.trims.to_json_dict(),
        }


# The columns the sections read (a DataFrame is handed to DuckDB with these alone).
_SECTION_COLUMNS: Final = ("conversation_id", "turn", "turn_bucket", "prompt_tokens", "prompt_bucket", "verdict",
                           "reused", "ttft_ms", "remote_tokens", "transfer_bytes", "transfer_ms", "gap_s",
                           "metadata_reason", *_TRIM_COLUMNS)


def open_turns(table: TurnData) -> TurnTable:
    """The turn table opened for the sections' queries (a DataFrame is handed over with the columns they read)."""
    if isinstance(table, pa.Table):
        return TurnTable(table)
    return TurnTable(pa.Table.from_pandas(normalize_table(table).loc[:, list(_SECTION_COLUMNS)], preserve_index=False))


def build_report(table: TurnData, decoder_ttl_s: float | None = None) -> Report:
    """Compute every report section from the turn table (a DataFrame, or the Arrow table the CLI keeps)."""
    with open_turns(table) as tt:
        turns, conversations = totals(tt)
        if not turns:
            raise ReportError("no turns found in the given logs; check the paths (kvdiag explain --all LOGS names "
                              "the files it could not recognise)")
        return Report(table=table, turns=turns, conversations=conversations,
                      outcome_by_turn=outcome_mix_section(tt, "turn_bucket"),
                      outcome_by_prompt=outcome_mix_section(tt, "prompt_bucket"), ttft_by_prompt=ttft_section(tt),
                      transfer_by_prompt=transfer_section(tt), first_vs_later=first_later_section(tt),
                      gaps=summarize_gaps(tt, decoder_ttl_s), trims=trim_summary(tt))


def load_turn_table(paths: Sequence[str | Path] | StagedInputs, *, cache_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    events_only: bool = False, config_lines: bool = False) -> pd.DataFrame:
    """Parse and correlate ``paths`` (files, globs, folders, .gz, container log wrappers, ``s3://`` URLs;
    or inputs already staged by kvdiag.diagnostics.sources) into the turn table, through the Parquet
    cache when ``cache_dir`` is set: the verdict engine's table, the same verdicts explain gives. Raises
    explain's LogReadError/ExplainError.

    ``events_only``: use only the event files among the inputs (faster; but turns only stock logs show
    are lost, and the fields and reasons stock lines add to the other turns are missing).
    ``config_lines``: the logs' configuration lines are kept, as they are read, for the next
    kvdiag.diagnostics.advise_config.scan_config of the same files (which then reads them no second time).
    ``s3://`` objects are mirrored under ``cache_dir/s3`` (reused while their ETag holds)."""
    return table_frame(load_turn_arrow(paths, cache_dir=cache_dir, progress=progress, events_only=events_only,
                                       config_lines=config_lines))


def load_turn_arrow(paths: Sequence[str | Path] | StagedInputs, *, cache_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    events_only: bool = False, config_lines: bool = False) -> pa.Table:
    """:func:`load_turn_table` as an Arrow table (what build_report reads without pandas)."""
    if isinstance(paths, StagedInputs):
        return _load_staged(paths, cache_dir, progress, events_only, config_lines)
    mirror_dir = cache_dir / "s3" if cache_dir is not None else None
    with stage_inputs([str(p) for p in paths], mirror_dir=mirror_dir) as staged:
        return _load_staged(staged, cache_dir, progress, events_only, config_lines)


def _load_staged(staged: StagedInputs, cache_dir: Path | None, progress: Callable[[int, int], None] | None,
                 events_only: bool, config_lines: bool) -> pa.Table:
    # The cache is keyed by the inputs as given (a wrapped log's own path, size and mtime; an object's
    # mirrored copy), so a hit needs no unwrapping; the files read are the staged ones.
    key = list(staged.identity)
    files: list[str] = []
    if events_only:
        files = [f.path for f in detect(staged.paths) if f.fmt == "events"]
        if not files:
            raise ReportError("--events-only: no kvdiag event files among the inputs")
        key = sorted({staged.origin.get(f, f) for f in files})
    if cache_dir is not None:
        cached = report_cache.load_cached_table(key, cache_dir, TABLE_VERSION)
        if cached is not None:
            _check_columns(cached.column_names)
            return cached
    if not events_only:
        files = staged.paths  # wrapped inputs are unwrapped here, on a miss only
    table = engine_table(files, progress, config_lines=config_lines)
    if staged.renamed and table.num_rows:
        reasons = [staged.display(r) for r in table.column("reason").to_pylist()]
        table = table.set_column(table.column_names.index("reason"), "reason", pa.array(reasons, pa.string()))
    if cache_dir is not None:
        report_cache.store_cached_table(table, key, cache_dir, TABLE_VERSION)
    return table


_ENGINE_RAW: Final = ", ".join(
    "CASE WHEN ev_gap_s IS NULL AND prev_sid IS NOT NULL THEN client_gap ELSE ev_gap_s END AS gap_s" if c == "gap_s"
    else "start_ts + latency_ms / 1000.0 AS end_ts" if c == "end_ts" else c for c in RAW_COLUMNS)


def engine_table(files: Sequence[str], progress: Callable[[int, int], None] | None = None, *,
                 config_lines: bool = False) -> pa.Table:
    """The turn table of ``files`` (local, bare) from the verdict engine (the rules explain applies);
    ``config_lines`` as for load_turn_table."""
    try:
        detected = detect(files)
    except LogReadError as exc:
        raise UnreadableLogError(str(exc)) from None
    run = run_all(detected, progress, evidence=False, config_lines=config_lines)
    try:
        return _engine_run_table(run)
    finally:
        run.con.close()


def _engine_run_table(run: Run) -> pa.Table:
    """The turn table of a run the engine has decided."""
    # the benchmark's own clock gives a gap to 3 decimals as Python rounds it (explain's records do the same);
    # the rounded gaps are joined in by the turn's key (copying a million wide rows to update them costs a second)
    run.con.execute(f"CREATE TEMP VIEW raw_turns_view AS SELECT {_ENGINE_RAW}, sid, prev_sid, ev_gap_s IS NULL AND "
                    "prev_sid IS NOT NULL AND client_gap IS NOT NULL AS client_gap_used FROM decided")
    rounded = run.con.sql("SELECT sid, gap_s FROM raw_turns_view WHERE client_gap_used").to_arrow_table()
    if not rounded.num_rows:
        return _derive(run.con, "raw_turns_view", "sid", "prev_sid")
    # (client_gap_used: never NULL; an array built from Python objects would make pyarrow import pandas)
    gaps = np.array([round(g, 3) for g in rounded.column(1).to_pylist()], dtype=np.float64)
    gap_fix = rounded.set_column(1, "gap_s", pa.Array.from_buffers(pa.float64(), len(gaps), [None, pa.py_buffer(gaps)]))
    run.con.register("gap_fix", gap_fix)
    source = ("(SELECT v.* REPLACE (CASE WHEN v.client_gap_used THEN g.gap_s ELSE v.gap_s END AS gap_s) "
              "FROM raw_turns_view v LEFT JOIN gap_fix g ON g.sid = v.sid)")
    return _derive(run.con, source, "sid", "prev_sid")


def write_outputs(report: Report, *, csv: Path | None = None, parquet_path: Path | None = None,
                  json_path: Path | None = None) -> list[Path]:
    """Write the per-turn table (CSV/Parquet) and the aggregated JSON; return the paths written."""
    written: list[Path] = []
    if csv is not None:
        as_frame(report.table).to_csv(csv, index=False)
        written.append(csv)
    if parquet_path is not None:
        report_cache.write_table(as_frame(report.table), parquet_path)
        written.append(parquet_path)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json_dict(), indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    return written
