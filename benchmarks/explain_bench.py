"""Benchmark ``kvdiag explain`` against ``grep -F`` and DuckDB's raw scan of the same files, in one run.

* one conversation: ``explain_conversation`` vs ``grep -F <id> FILES`` (target: ≤ 2×);
* every conversation: ``load_turns`` vs DuckDB ``read_csv`` of every line of the same files (target: ≤ 2×).
Files are read once first so every contender runs on a warm page cache; each figure is the median
of ``--repeat`` runs; the ``--all`` rounds interleave DuckDB and kvdiag and also list each round's ratio.

    .venv/bin/python benchmarks/gen_logs.py --size 1GB
    .venv/bin/python benchmarks/explain_bench.py --data benchmarks/data/1024MB --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvdiag.diagnostics.explain import explain_conversation, load_turns


def _median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (this process + its children, e.g. grep)."""
    walls, cpus = [], []
    for _ in range(repeat):
        c0, p0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time(), time.perf_counter()
        fn()
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - p0 + c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


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
    ap.add_argument("--skip-one", action="store_true", help="Only the --all figures.")
    args = ap.parse_args(argv)
    files = sorted(str(p) for p in args.data.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    for f in files:  # warm the page cache for every contender alike
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    rows: list[dict[str, object]] = []

    def row(case: str, ours: tuple[float, float], baseline: str, base: tuple[float, float]) -> None:
        rows.append({"case": case, "kvdiag_s": round(ours[0], 3), "baseline": baseline, "baseline_s": round(base[0], 3),
                     "ratio": round(ours[0] / base[0], 2), "kvdiag_cpu_s": round(ours[1], 3),
                     "baseline_cpu_s": round(base[1], 3), "cpu_ratio": round(ours[1] / base[1], 2)})

    with tempfile.TemporaryDirectory() as tmp:
        stock = Path(tmp)  # the same data set without kvdiag events: what an unmodified deployment leaves
        for name in ("prefill.log", "decode.log", "proxy.log", "client-stats.jsonl"):
            (stock / name).symlink_to((args.data / name).resolve())
        stock_files = sorted(str(p) for p in stock.iterdir())
        for conv in [] if args.skip_one else args.ids:
            base = _median(lambda c=conv: _grep(files, c), args.repeat)
            ours = _median(lambda c=conv: explain_conversation([str(args.data)], c), args.repeat)
            row(f"one conversation ({conv}), all files", ours, "grep -F", base)
            base = _median(lambda c=conv: _grep(stock_files, c), args.repeat)
            ours = _median(lambda c=conv: explain_conversation([str(stock)], c), args.repeat)
            row(f"one conversation ({conv}), stock files only", ours, "grep -F", base)
    if not args.skip_all:
        # Interleaved rounds (DuckDB, then kvdiag, back to back): the shared machine's load changes by
        # the minute, so each round's ratio is the figure; medians over rounds are reported.
        base_runs, our_runs = [], []
        for _ in range(args.repeat):
            base_runs.append(_median(lambda: _duckdb_scan(files), 1))
            our_runs.append(_median(lambda: load_turns([str(args.data)]), 1))
        base = (statistics.median(b[0] for b in base_runs), statistics.median(b[1] for b in base_runs))
        ours = (statistics.median(o[0] for o in our_runs), statistics.median(o[1] for o in our_runs))
        row("--all", ours, "DuckDB read_csv raw scan", base)
        rows[-1]["round_wall_ratios"] = [round(o[0] / b[0], 2) for o, b in zip(our_runs, base_runs, strict=True)]
        rows[-1]["round_cpu_ratios"] = [round(o[1] / b[1], 2) for o, b in zip(our_runs, base_runs, strict=True)]
    doc = {"data": str(args.data), "bytes": size, "files": len(files), "cpus": os.cpu_count(),
           "python": platform.python_version(), "rows": rows}
    print(json.dumps(doc, indent=2))
    print("\n| case | kvdiag wall s | baseline | baseline wall s | wall ratio | kvdiag CPU s | baseline CPU s | "
          "CPU ratio |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kvdiag_s']} | {r['baseline']} | {r['baseline_s']} | {r['ratio']}× | "
              f"{r['kvdiag_cpu_s']} | {r['baseline_cpu_s']} | {r['cpu_ratio']}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
