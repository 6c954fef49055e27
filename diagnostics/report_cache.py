"""Parquet sink for the per-turn table, and the cache that makes a second `kvdiag report` fast.

The cache key is a digest of every input's (absolute path, size, mtime) plus the table version,
so any change to any input (or to the table's columns) misses and the logs are parsed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

# (DuckDB and pyarrow are imported where a table is read or written: the CLI's help reads DEFAULT_CACHE_DIR)

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR: Final = Path(os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))) / "kvdiag"


def cache_key(paths: Sequence[str | Path], version: int) -> str:
    """Digest of the inputs' identities: (resolved path, size, mtime_ns) each, order-independent, and
    the table ``version`` (a column change must miss)."""
    parts = []
    for p in paths:
        path = Path(p).resolve()
        st = path.stat()
        parts.append([str(path), st.st_size, st.st_mtime_ns])
    payload = json.dumps({"v": version, "inputs": sorted(parts)}, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def cache_path(paths: Sequence[str | Path], cache_dir: Path, version: int) -> Path:
    """Where the turn table for ``paths`` is cached."""
    return cache_dir / f"turns-{cache_key(paths, version)}.parquet"


def write_table(table: pa.Table | pd.DataFrame, path: Path) -> None:
    """Write the turn table (Arrow or pandas) as Parquet (zstd), atomically (temp file then rename)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    arrow = table if isinstance(table, pa.Table) else pa.Table.from_pandas(table, preserve_index=False)
    pq.write_table(arrow, tmp, compression="zstd")
    tmp.replace(path)


def read_table(path: Path) -> pa.Table:
    """Read a turn table written by :func:`write_table`."""
    import duckdb  # noqa: PLC0415

    # (read by DuckDB: pyarrow's reader imports pandas, a third of a cached report's run)
    con = duckdb.connect()
    try:
        return con.sql("SELECT * FROM read_parquet($p)", params={"p": str(path)}).to_arrow_table()
    except duckdb.Error as exc:
        raise OSError(f"unreadable Parquet file {path}: {exc}") from None
    finally:
        con.close()


def load_cached_table(paths: Sequence[str | Path], cache_dir: Path, version: int) -> pa.Table | None:
    """Return the cached table for ``paths``, or None on a miss or an unreadable cache file."""
    target = cache_path(paths, cache_dir, version)
    if not target.exists():
        return None
    import pyarrow as pa  # noqa: PLC0415

    try:
        return read_table(target)
    except (OSError, pa.ArrowException) as exc:
        # A torn or foreign file is a miss, never an error: the logs are the source of truth.
        log.warning("ignoring unreadable cache file %s: %s", target, exc)
        return None


def store_cached_table(table: pa.Table | pd.DataFrame, paths: Sequence[str | Path], cache_dir: Path,
                       version: int) -> Path | None:
    """Cache ``table`` for ``paths``; return its path, or None when the cache dir is not writable."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        target = cache_path(paths, cache_dir, version)
        write_table(table, target)
    except OSError as exc:
        log.warning("cannot write the report cache under %s: %s", cache_dir, exc)
        return None
    return target
