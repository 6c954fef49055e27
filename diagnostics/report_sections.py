"""The report's sections from the turn table, without pandas: counts grouped by DuckDB over an Arrow table,
quantiles by numpy as pandas takes them (``np.quantile``, linear), ratios rounded as pandas rounds them.

A section is a small table (a row per bucket, a column per figure) that the terminal, the JSON document and
pandas users read alike. The turn table itself may hold a million rows; it is read once per section, in DuckDB,
and only the figures come back to Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, overload

import duckdb
import numpy as np
import pyarrow as pa

from kvdiag.schema.metrics import PROMPT_BUCKETS, TURN_BUCKETS
from kvdiag.schema.verdicts import REUSED_VERDICTS, Verdict

if TYPE_CHECKING:
    import pandas as pd

EXPIRED_VERDICTS: Final = frozenset({Verdict.EXPIRED_REMOTE_READ, Verdict.ROUTER_ENTRY_EXPIRED})
# vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN: P declines a read whose deadline is within 5 s.
EXPIRY_SAFETY_MARGIN_S: Final = 5.0
GAP_HISTOGRAM_BINS: Final = 30


@dataclass(frozen=True)
class Section:
    """A small table: one row per entry of ``index`` (named ``index_name``), one value per column."""

    index_name: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, tuple[Any, ...]], ...]  # (index entry, its values); None is a missing value
    float_columns: frozenset[str] = field(default=frozenset())  # float in pandas even when every value is None

    @property
    def index(self) -> list[Any]:
        """The index entries, in order."""
        return [key for key, _ in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str) -> list[Any]:
        """One column's values, in row order."""
        i = self.columns.index(name)
        return [values[i] for _, values in self.rows]

    def row(self, key: Any) -> dict[str, Any] | None:
        """The row of index entry ``key`` as {column: value} (None when there is no such row)."""
        for k, values in self.rows:
            if k == key:
                return dict(zip(self.columns, values, strict=True))
        return None

    def items(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        """(index entry, {column: value}) per row."""
        for key, values in self.rows:
            yield key, dict(zip(self.columns, values, strict=True))

    def records(self) -> list[dict[str, Any]]:
        """Each row as {index_name: entry, column: value, ...} (the report's JSON rows)."""
        return [{self.index_name: key, **dict(zip(self.columns, values, strict=True))} for key, values in self.rows]

    def to_pandas(self) -> pd.DataFrame:
        """The section as a DataFrame indexed by ``index_name``."""
        import pandas as pd  # noqa: PLC0415 - the terminal report needs no pandas

        df = pd.DataFrame(self.records(), columns=[self.index_name, *self.columns]).set_index(self.index_name)
        for c in self.float_columns:
            df[c] = df[c].astype("float64")
        return df


class SectionFrame:
    """An attribute giving the Section held in another attribute as a DataFrame (built on each access)."""

    def __init__(self, section: str) -> None:
        self.section = section

    @overload
    def __get__(self, owner_obj: None, owner: type | None = None) -> SectionFrame: ...

    @overload
    def __get__(self, owner_obj: object, owner: type | None = None) -> pd.DataFrame: ...

    def __get__(self, owner_obj: object | None, owner: type | None = None) -> pd.DataFrame | SectionFrame:
        if owner_obj is None:  # (on the class: the attribute itself, as help() and introspection expect)
            return self
        section: Section = getattr(owner_obj, self.section)
        return section.to_pandas()


def quantile(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    """The ``q`` quantile as pandas' Series.quantile gives it (None for no values)."""
    arr = np.asarray(values, dtype=np.float64)
    return float(np.quantile(arr, np.asarray([q], dtype=np.float64), method="linear")[0]) if len(arr) else None


def _round4(ratio: float) -> float:
    return float(np.round(np.float64(ratio), 4))  # (as pandas' Series.round: numpy's, half to even)


def _known(col: str) -> str:
    """SQL: a value is there (not NULL, not NaN: pandas counts both as missing)."""
    return f"({col} IS NOT NULL AND NOT isnan(CAST({col} AS DOUBLE)))"


class TurnTable:
    """An Arrow turn table opened in DuckDB for the sections' queries (as ``t``)."""

    def __init__(self, table: pa.Table) -> None:
        self.con = duckdb.connect()
        self.con.register("t", table)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> TurnTable:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        return self.con.execute(sql).fetchall()

    def rows_with_arrays(self, sql: str) -> list[tuple[Any, ...]]:
        """Rows whose list values come back as numpy arrays (a list of Python floats per turn costs more than the
        whole query); a NULL list is an empty array."""
        table = self.con.sql(sql).to_arrow_table()
        columns: list[list[Any]] = []
        for col in table.columns:
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                columns.append([_doubles(v.values) if v.is_valid else np.empty(0) for v in col])
            else:
                columns.append(col.to_pylist())
        return list(zip(*columns, strict=True))


def _doubles(values: pa.Array) -> np.ndarray:
    """A DOUBLE array without NULLs as numpy, on Arrow's own buffer (Array.to_numpy imports pandas)."""
    if values.type != pa.float64() or values.null_count:
        raise ValueError(f"expected DOUBLE values without NULLs, got {values.type} with {values.null_count} NULL(s)")
    return np.frombuffer(values.buffers()[1], dtype=np.float64, count=len(values), offset=values.offset * 8)


def totals(tt: TurnTable) -> tuple[int, int]:
    """Turns and conversations in the table."""
    turns, conversations = tt.rows("SELECT count(*), count(DISTINCT conversation_id) FROM t")[0]
    return int(turns), int(conversations)


def outcome_mix_section(tt: TurnTable, by: str) -> Section:
    """Turn counts per verdict for each bucket of ``by`` (turn_bucket or prompt_bucket), their total and the
    share reused; verdicts no turn has are left out."""
    order = TURN_BUCKETS if by == "turn_bucket" else PROMPT_BUCKETS if by == "prompt_bucket" else None
    if order is None:
        raise ValueError(f"outcome_mix groups by turn_bucket or prompt_bucket, not {by!r}")
    counts = {(b, v): int(n) for b, v, n in tt.rows(
        f"SELECT {by}, verdict, count(*) FROM t WHERE {by} IS NOT NULL AND verdict IS NOT NULL GROUP BY ALL")}
    verdicts = [v.value for v in Verdict if any(counts.get((b, v.value), 0) for b in order)]
    reused = {v.value for v in REUSED_VERDICTS}
    rows = []
    for b in order:
        per = [counts.get((b, v), 0) for v in verdicts]
        turns = sum(per)
        share = _round4(sum(n for v, n in zip(verdicts, per, strict=True) if v in reused) / turns) if turns else None
        rows.append((b, (turns, *per, share)))
    return Section(by, ("turns", *verdicts, "reused_share"), tuple(rows), frozenset({"reused_share"}))


def _groups(tt: TurnTable, keys: str, values: str, where: str) -> dict[Any, np.ndarray]:
    return {tuple(k) if len(k) > 1 else k[0]: vals for *k, vals in tt.rows_with_arrays(
        f"SELECT {keys}, list(CAST({values} AS DOUBLE)) FROM t WHERE {where} GROUP BY ALL")}


def ttft_section(tt: TurnTable) -> Section:
    """TTFT p50/p95 of later turns, reused vs recomputed, per prompt-length bucket (the article's table)."""
    # (a failed turn's TTFT is the time to its error: among the recomputed ones it would pass for a fast prefill;
    # an unknown turn may have been either, and stock logs at INFO leave every hit unknown: counted as recomputed,
    # they would pull its TTFT towards the reused one's and hide the speed-up)
    groups = _groups(tt, "prompt_bucket, coalesce(reused, false)", "ttft_ms",
                     f"turn > 1 AND {_known('ttft_ms')} AND prompt_bucket IS NOT NULL "
                     f"AND coalesce(verdict NOT IN ('{Verdict.REQUEST_FAILED.value}', '{Verdict.UNKNOWN.value}'), "
                     "true)")
    cols = ("reused_n", "reused_p50_ms", "reused_p95_ms", "recomputed_n", "recomputed_p50_ms", "recomputed_p95_ms",
            "speedup_p50")
    rows = []
    for bucket in PROMPT_BUCKETS:
        values: list[Any] = []
        p50: dict[bool, float | None] = {}
        for reused in (True, False):
            part = groups.get((bucket, reused), np.empty(0))
            p50[reused] = quantile(part, 0.5)
            values += [len(part), p50[reused], quantile(part, 0.95)]
        p_re, p_rc = p50[True], p50[False]
        values.append(round(p_rc / p_re, 2) if p_re and p_rc else None)
        rows.append((bucket, tuple(values)))
    return Section("prompt_bucket", cols, tuple(rows))


def transfer_section(tt: TurnTable) -> Section:
    """D→P transfer bytes and milliseconds per prompt-length bucket (turns that read from D)."""
    got = {b: (int(n), int(total), sizes, ms) for b, n, total, sizes, ms in tt.rows_with_arrays(
        f"""SELECT prompt_bucket, count(*), sum(transfer_bytes), list(CAST(transfer_bytes AS DOUBLE)),
                   list(CAST(transfer_ms AS DOUBLE)) FILTER (WHERE {_known('transfer_ms')})
            FROM t WHERE {_known('transfer_bytes')} AND transfer_bytes > 0 AND prompt_bucket IS NOT NULL
            GROUP BY 1""")}
    rows = []
    for bucket in PROMPT_BUCKETS:
        n, total, sizes, ms = got.get(bucket, (0, 0, np.empty(0), np.empty(0)))
        rows.append((bucket, (n, quantile(sizes, 0.5), total, quantile(ms, 0.5), quantile(ms, 0.95))))
    return Section("prompt_bucket", ("transfers", "bytes_p50", "bytes_total", "ms_p50", "ms_p95"), tuple(rows))


def first_later_section(tt: TurnTable) -> Section:
    """First turns (nothing to retrieve) against later turns: counts, reuse share, the share the logs leave
    unknown (reused or not: ``reused_share`` counts only what they prove), TTFT."""
    query = f"""SELECT CASE WHEN turn = 1 THEN 'first' ELSE 'later' END, count(*),
                 count(*) FILTER (WHERE coalesce(reused, false)),
                 count(*) FILTER (WHERE verdict = '{Verdict.UNKNOWN.value}'),
                 list(CAST(ttft_ms AS DOUBLE)) FILTER (WHERE {_known('ttft_ms')}),
                 list(CAST(prompt_tokens AS DOUBLE)) FILTER (WHERE {_known('prompt_tokens')})
               FROM t WHERE turn >= 1 GROUP BY 1"""
    got = {label: (int(n), int(reused or 0), int(unknown or 0), ttft, prompt)
           for label, n, reused, unknown, ttft, prompt in tt.rows_with_arrays(query)}
    rows = []
    for label in ("first", "later"):
        n, reused, unknown, ttft, prompt = got.get(label, (0, 0, 0, np.empty(0), np.empty(0)))
        rows.append((label, (n, round(reused / n, 4) if n else None, round(unknown / n, 4) if n else None,
                             quantile(ttft, 0.5), quantile(ttft, 0.95), quantile(prompt, 0.5))))
    return Section("turns", ("n", "reused_share", "unknown_share", "ttft_p50_ms", "ttft_p95_ms", "prompt_tokens_p50"),
                   tuple(rows))


@dataclass
class GapSummary:
    """Inter-turn gaps against the decode TTL, and the expired / missing-metadata ratios."""

    later_turns: int
    gaps_known: int
    decoder_ttl_s: float | None
    quantiles_s: dict[str, float | None]
    share_over_ttl: float | None
    share_within_margin: float | None
    expired_ratio: float | None
    missing_metadata_ratio: float | None
    missing_metadata_reasons: dict[str, int]
    histogram_edges_s: list[float] = field(default_factory=list)
    histogram_counts: list[int] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON form (report --json ``gaps``)."""
        return dict(self.__dict__)


def gap_histogram(gaps: Sequence[float] | np.ndarray, ttl: float | None,
                  bins: int = GAP_HISTOGRAM_BINS) -> tuple[list[float], list[int]]:
    """Equal-width bins from 0 to max(gaps, 1.1 × TTL), so the TTL line always falls inside the plot."""
    values = np.asarray(gaps, dtype="float64")
    if not len(values):
        return [], []
    top = max(float(values.max()), (ttl or 0.0) * 1.1, 1e-9)
    width = top / bins
    idx = np.minimum((values / width).astype("int64"), bins - 1)
    counts = np.bincount(idx, minlength=bins)
    return [round(i * width, 6) for i in range(bins + 1)], [int(c) for c in counts]


def summarize_gaps(tt: TurnTable, decoder_ttl_s: float | None) -> GapSummary:
    """Summarize later turns' gaps against ``decoder_ttl_s`` (None: TTL unknown, shares omitted)."""
    expired = ", ".join(f"'{v.value}'" for v in sorted(EXPIRED_VERDICTS))
    missing = f"verdict = '{Verdict.METADATA_NOT_RETURNED.value}'"
    n_later, n_expired, n_missing, gaps = tt.rows_with_arrays(
        f"""SELECT count(*), count(*) FILTER (WHERE verdict IN ({expired})), count(*) FILTER (WHERE {missing}),
                   list(CAST(gap_s AS DOUBLE)) FILTER (WHERE {_known('gap_s')}) FROM t WHERE turn > 1""")[0]
    values = gaps
    n_gaps = len(values)
    over = within = None
    if decoder_ttl_s is not None and n_gaps:
        over = round(int((values >= decoder_ttl_s).sum()) / n_gaps, 4)
        within = round(int((values >= decoder_ttl_s - EXPIRY_SAFETY_MARGIN_S).sum()) / n_gaps, 4)
    # most frequent first, ties in the table's order as pandas' value_counts gives them (a filtered scan keeps
    # the rows' order)
    reasons = Counter("unknown" if r is None else r for (r,) in tt.rows(
        f"SELECT metadata_reason FROM t WHERE turn > 1 AND {missing}"))
    edges, counts = gap_histogram(values, decoder_ttl_s)
    return GapSummary(
        later_turns=n_later, gaps_known=n_gaps, decoder_ttl_s=decoder_ttl_s,
        quantiles_s={f"p{int(q * 100)}": quantile(values, q) for q in (0.5, 0.9, 0.95, 0.99)},
        share_over_ttl=over, share_within_margin=within,
        expired_ratio=round(n_expired / n_later, 4) if n_later else None,
        missing_metadata_ratio=round(n_missing / n_later, 4) if n_later else None,
        missing_metadata_reasons=dict(reasons.most_common()),
        histogram_edges_s=edges, histogram_counts=counts,
    )
