"""Benchmark ``kvdiag explain`` against ``grep -F`` and DuckDB's raw scan of the same files, in one run.

* one conversation: ``explain_conversation`` vs ``grep -F <id> FILES`` (target: ≤ 2×);
* every conversation: ``load_turns`` vs DuckDB ``read_csv`` of every line of the same files (target: ≤ 2×).
Files are read once first so every contender runs on a warm page cache; each figure is the median
of ``--repeat`` runs (``--all`` runs once per repeat too).

    .venv/bin/python benchmarks/gen_logs.py --size 1GB
    .venv/bin/python benchmarks/explain_bench.py --data benchmarks/data/1024MB --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvdiag.diagnostics.explain import explain_conversation, load_turns


def _median(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _grep(files: list[str], needle: str) -> None:
    subprocess.run(["grep", "-F", needle, *files], stdout=subprocess.DEVNULL, check=False,
                   env={**os.environ, "LC_ALL": "C"})


def _duckdb_scan(files: list[str]) -> int:
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar=false")
    rows = con.execute(
        "SELECT count(*) FROM read_csv($files, columns={'line': 'VARCHAR'}, delim=chr(1), header=false, "
        "quote='', escape='', auto_detect=false)", {"files": files}).fetchone()
    return int(rows[0]) if rows else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "1024MB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ids", nargs="*", default=["CONV_ID_17777", "CONV_ID_250", "CONV_ID_31000"])
    ap.add_argument("--skip-all", action="store_true", help="Only the one-conversation figures.")
    args = ap.parse_args(argv)
    files = sorted(str(p) for p in args.data.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    for f in files:  # warm the page cache for every contender alike
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    rows: list[dict[str, object]] = []
    for conv in args.ids:
        t_grep = _median(lambda c=conv: _grep(files, c), args.repeat)
        t_explain = _median(lambda c=conv: explain_conversation([str(args.data)], c), args.repeat)
        rows.append({"case": f"one conversation ({conv})", "kvdiag_s": round(t_explain, 3),
                     "baseline": "grep -F", "baseline_s": round(t_grep, 3), "ratio": round(t_explain / t_grep, 2)})
    if not args.skip_all:
        t_duck = _median(lambda: _duckdb_scan(files), args.repeat)
        t_all = _median(lambda: load_turns([str(args.data)]), max(1, min(args.repeat, 2)))
        rows.append({"case": "--all", "kvdiag_s": round(t_all, 3), "baseline": "DuckDB read_csv raw scan",
                     "baseline_s": round(t_duck, 3), "ratio": round(t_all / t_duck, 2)})
    doc = {"data": str(args.data), "bytes": size, "files": len(files), "cpus": os.cpu_count(),
           "python": platform.python_version(), "rows": rows}
    print(json.dumps(doc, indent=2))
    print("\n| case | kvdiag (s) | baseline | baseline (s) | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kvdiag_s']} | {r['baseline']} | {r['baseline_s']} | {r['ratio']}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
