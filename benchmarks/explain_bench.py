"""Benchmark ``kvdiag explain`` against ``grep -F`` and DuckDB's raw scan of the same files, in one run.

* one conversation: ``explain_conversation`` in this process, and ``kvdiag explain DIR --conversation ID``
  as a subprocess (interpreter start included), vs ``grep -F <id> FILES`` (target: ≤ 2× in wall time
  and in CPU);
* every conversation: ``summarize_conversations`` (what ``explain --all`` lists), ``load_turns`` (every record:
  what ``explain --all --json`` and ``--html`` read) and the CLI ``kvdiag explain DIR --all`` as a subprocess
  (printing into a pipe included) vs DuckDB ``read_csv`` of every line of the same files, counted (``count(*)``,
  the baseline of the earlier figures) and materialized (``CREATE TABLE``, report_bench.py's baseline)
  (target: ≤ 2×).
Files are read once first so every contender runs on a warm page cache. Rounds are interleaved (the
baseline, then kvdiag, back to back); each figure is the median over ``--repeat`` rounds, and the ratio
is taken per round, then the median (CPU: this process's threads + its children, grep and the CLI).

    .venv/bin/python benchmarks/gen_logs.py --size 1GB
    .venv/bin/python benchmarks/explain_bench.py --data benchmarks/data/1024MB --repeat 3
    git worktree add /tmp/before/kvdiag <commit> && .venv/bin/python benchmarks/explain_bench.py --skip-all \
        --compare-tree /tmp/before     # the CLI before a change, in the same rounds
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

from installed_bytecode import compile_package

from kvdiag.diagnostics.turn_loader import explain_conversation, load_turns, summarize_conversations


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process + its children, e.g. grep or the CLI)."""
    c0, p0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time(), time.perf_counter()
    fn()
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - t0, time.process_time() - p0 + c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime


# Both write their output into a pipe this process reads, as a person reading it would: GNU grep writing to
# /dev/null stops reading each file at its first match (it knows nobody sees the lines), which no real use gets.
def _cli(data: Path, conversation_id: str | None, tree: Path | None = None) -> None:
    """``kvdiag explain DATA`` for one conversation, or ``--all`` (``conversation_id`` None)."""
    exe = Path(sys.executable).with_name("kvdiag")
    # (tree: another checkout's code, e.g. the commit before a change, imported as kvdiag through PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    which = ["--conversation", conversation_id] if conversation_id is not None else ["--all"]
    subprocess.run([str(exe), "explain", str(data), *which, "--no-progress"], stdout=subprocess.PIPE, check=True,
                   env=env)


def _grep(files: list[str], needle: str) -> None:
    subprocess.run(["grep", "-F", needle, *files], stdout=subprocess.PIPE, check=False,
                   env={**os.environ, "LC_ALL": "C"})


def _duckdb_scan(files: list[str]) -> int:
    import duckdb

    con = duckdb.connect()
    con.execute("SET enable_progress_bar=false")
    rows = con.execute(
        "SELECT count(*) FROM read_csv($files, columns={'line': 'VARCHAR'}, delim=chr(1), header=false, "
        "quote='', escape='', auto_detect=false)", {"files": files}).fetchone()
    return int(rows[0]) if rows else 0


def _duckdb_table(files: list[str]) -> None:
    import duckdb

    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE t AS SELECT * FROM read_csv($files, columns={'line': 'VARCHAR'}, delim=chr(1), "
                    "header=false, quote='', escape='', strict_mode=false)", {"files": files})
    finally:
        con.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(__file__).parent / "data" / "1024MB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ids", nargs="*", default=["CONV_ID_17777", "CONV_ID_250", "CONV_ID_31000"])
    ap.add_argument("--skip-all", action="store_true", help="Only the one-conversation figures.")
    ap.add_argument("--skip-one", action="store_true", help="Only the --all figures.")
    ap.add_argument("--compare-tree", type=Path, metavar="DIR",
                    help="Also time the one-conversation CLI with the kvdiag package under DIR (DIR/kvdiag, e.g. a "
                         "worktree of an earlier commit), in the same rounds.")
    args = ap.parse_args(argv)
    compile_package()  # the CLI child imports kvdiag as an installed one would: from bytecode
    if args.compare_tree is not None:
        compile_package(args.compare_tree)
    files = sorted(str(p) for p in args.data.iterdir() if p.is_file())
    size = sum(os.path.getsize(f) for f in files)
    for f in files:  # warm the page cache for every contender alike
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    rows: list[dict[str, object]] = []

    def interleaved(case: str, baselines: dict[str, Callable[[], object]], ours_fn: Callable[[], object],
                    *others: tuple[str, Callable[[], object]]) -> None:
        """Time the baselines, ``ours_fn`` (``case``) and each of ``others`` (case, function) in the same rounds."""
        base_runs: dict[str, list[tuple[float, float]]] = {name: [] for name in baselines}
        our_runs: list[tuple[float, float]] = []
        other_runs: list[list[tuple[float, float]]] = [[] for _ in others]
        for _ in range(args.repeat):
            for name, fn in baselines.items():
                base_runs[name].append(_timed(fn))
            our_runs.append(_timed(ours_fn))
            for (_name, fn), runs in zip(others, other_runs, strict=True):
                runs.append(_timed(fn))
        for (name, _fn), runs in zip(others, other_runs, strict=True):
            record(name, base_runs, runs)
        record(case, base_runs, our_runs)

    def record(case: str, base_runs: dict[str, list[tuple[float, float]]], our_runs: list[tuple[float, float]]
               ) -> None:
        for name, runs in base_runs.items():
            walls = [o[0] / b[0] for o, b in zip(our_runs, runs, strict=True)]
            cpus = [o[1] / b[1] for o, b in zip(our_runs, runs, strict=True)]
            rows.append({"case": case, "kvdiag_s": round(statistics.median(o[0] for o in our_runs), 3),
                         "baseline": name, "baseline_s": round(statistics.median(b[0] for b in runs), 3),
                         "ratio": round(statistics.median(walls), 2),
                         "kvdiag_cpu_s": round(statistics.median(o[1] for o in our_runs), 3),
                         "baseline_cpu_s": round(statistics.median(b[1] for b in runs), 3),
                         "cpu_ratio": round(statistics.median(cpus), 2),
                         "round_wall_ratios": [round(r, 2) for r in walls],
                         "round_cpu_ratios": [round(r, 2) for r in cpus]})

    with tempfile.TemporaryDirectory() as tmp:
        stock = Path(tmp)  # the same data set without kvdiag events: what an unmodified deployment leaves
        for name in ("prefill.log", "decode.log", "proxy.log", "client-stats.jsonl"):
            (stock / name).symlink_to((args.data / name).resolve())
        stock_files = sorted(str(p) for p in stock.iterdir())
        sets = (("all files", args.data, files), ("stock files only", stock, stock_files))
        for conv in [] if args.skip_one else args.ids:
            for label, folder, fl in sets:
                interleaved(f"one conversation ({conv}), {label}", {"grep -F": lambda c=conv, fl=fl: _grep(fl, c)},
                            lambda c=conv, d=folder: explain_conversation([str(d)], c))
                tree = args.compare_tree
                case = f"CLI `kvdiag explain --conversation {conv}`, {label}"
                interleaved(case, {"grep -F": lambda c=conv, fl=fl: _grep(fl, c)}, lambda c=conv, d=folder: _cli(d, c),
                            *(() if tree is None else
                              ((f"{case}, code from {tree}", lambda c=conv, d=folder, t=tree: _cli(d, c, t)),)))
        if not args.skip_all:
            for label, folder, fl in sets:
                interleaved(f"--all list (`summarize_conversations`), {label}",
                            {"DuckDB read_csv count(*)": lambda fl=fl: _duckdb_scan(fl),
                             "DuckDB read_csv CREATE TABLE": lambda fl=fl: _duckdb_table(fl)},
                            lambda d=folder: summarize_conversations([str(d)]),
                            (f"--all, every record (`load_turns`: --json, --html), {label}",
                             lambda d=folder: load_turns([str(d)])),
                            (f"CLI `kvdiag explain --all` (printed into a pipe), {label}",
                             lambda d=folder: _cli(d, None)))
    doc = {"data": str(args.data), "bytes": size, "files": len(files), "cpus": os.cpu_count(),
           "python": platform.python_version(), "load_average": os.getloadavg(), "rows": rows}
    print(json.dumps(doc, indent=2))
    print("\n| case | kvdiag wall s | baseline | baseline wall s | wall ratio | kvdiag CPU s | baseline CPU s | "
          "CPU ratio |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['kvdiag_s']} | {r['baseline']} | {r['baseline_s']} | {r['ratio']}× | "
              f"{r['kvdiag_cpu_s']} | {r['baseline_cpu_s']} | {r['cpu_ratio']}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
