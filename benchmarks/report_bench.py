"""`kvdiag report` over ~1 GB of logs against DuckDB's raw scan of the same files (BENCHMARKS.md).

Three data sets:

* ``events``: kvdiag event logs only (client.jsonl + router-events.jsonl from the synthetic
  generator), the instrumented deployment: report builds the table in DuckDB (report_fast.py).
* ``mixed`` (optional, ``--mixed DIR``, e.g. ``benchmarks/data/1024MB`` from gen_logs.py): stock vLLM,
  proxy and client-stats logs beside the events: DuckDB again, the stock logs through report_stock.py;
  also checks that table equals explain's parser's (``duckdb_path_equals_parser``), and times the
  parser and ``events_only`` for reference.
* ``stock``: the same directory without its event files: only explain's parser decides stock verdicts.

The baseline is DuckDB reading every field of every record of the same files into a table
(``CREATE TABLE AS SELECT * FROM read_json_auto(...)``; text logs via ``read_csv`` one column per
line). Figures are medians over ``--repeat`` interleaved rounds of wall and CPU seconds, in one process, on a
warm page cache; ratios are per round, then the median.

    .venv/bin/python benchmarks/report_bench.py --size-mb 1024
    .venv/bin/python benchmarks/report_bench.py --size-mb 1024 --mixed benchmarks/data/1024MB
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

from kvdiag.diagnostics.detect import detect, expand_paths
from kvdiag.diagnostics.report import build_report, load_turn_table, normalize_table
from kvdiag.diagnostics.report_fast import fast_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations

BATCH = 4000  # conversations per generator batch (bounded memory)


def generate(out: Path, size_mb: int) -> list[Path]:
    """Write client.jsonl and router-events.jsonl totalling about ``size_mb`` MB."""
    out.mkdir(parents=True, exist_ok=True)
    client, router = out / "client.jsonl", out / "router-events.jsonl"
    target = size_mb * 1_000_000
    with client.open("w", encoding="utf-8") as fc, router.open("w", encoding="utf-8") as fr:
        seed = 0
        while fc.tell() + fr.tell() < target:
            convs = synthetic_conversations(SynthParams(conversations=BATCH, seed=seed))
            for c in convs:  # keep ids unique across batches
                c.conversation_id = f"b{seed}-{c.conversation_id}"
                for t in c.turns:
                    t.request_id = f"b{seed}-{t.request_id}"
            fc.writelines(line + "\n" for line in client_events(convs))
            fr.writelines(line + "\n" for line in router_events(convs))
            seed += 1
    return [client, router]


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process's threads + finished children, e.g. the CLI or grep)."""
    c0, p0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time(), time.perf_counter()
    fn()
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.perf_counter() - t0,
            time.process_time() - p0 + c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)


def duckdb_raw_scan(files: list[str]) -> None:
    """DuckDB materializing every record of the inputs (the baseline)."""
    con = duckdb.connect()
    try:
        json_files = [f.path for f in detect(files) if f.fmt in ("events",)]
        other = [f.path for f in detect(files) if f.fmt not in ("events",)]
        if json_files:
            con.execute("CREATE TABLE j AS SELECT * FROM read_json_auto($f, format = 'newline_delimited', "
                        "union_by_name = true)", {"f": json_files})
        if other:
            con.execute("CREATE TABLE t AS SELECT * FROM read_csv($f, columns = {'line': 'VARCHAR'}, header = false, "
                        "delim = '\\x01', quote = '', escape = '', strict_mode = false)", {"f": other})
    finally:
        con.close()


def report_once(files: list[str], *, cache_dir: Path | None = None, events_only: bool = False,
                fast: bool = True) -> int:
    df = load_turn_table(files, cache_dir=cache_dir, events_only=events_only, fast=fast)
    build_report(df, 480.0)
    return len(df)


def stock_changes(files: list[str]) -> dict[str, int]:
    """Per column, the turns whose value differs between the full table and the events-only one.

    Why it matters: the report may skip the stock logs only where they change nothing; any non-zero
    count here says the events alone do not decide the table (BENCHMARKS.md)."""
    key = ["conversation_id", "turn"]
    full = load_turn_table(files).sort_values(key).reset_index(drop=True)
    events = load_turn_table(files, events_only=True).sort_values(key).reset_index(drop=True)
    if len(full) != len(events) or not full[key].equals(events[key]):
        return {"turns_only_in_one_table": len(set(map(tuple, full[key].to_numpy())) ^
                                                   set(map(tuple, events[key].to_numpy())))}
    out = {}
    for col in full.columns:
        a, b = full[col], events[col]
        differ = ~((a == b).fillna(False).astype(bool) | (a.isna() & b.isna()))
        if int(differ.sum()):
            out[col] = int(differ.sum())
    return out


def same_table(files: list[str]) -> bool:
    """The DuckDB path's table equals explain's parser's (and the DuckDB path did not decline)."""
    key = ["conversation_id", "turn"]
    fast = fast_turn_table(files)
    if fast is None:
        return False
    slow = load_turn_table(files, fast=False).sort_values(key).reset_index(drop=True)
    return bool(normalize_table(fast).sort_values(key).reset_index(drop=True).equals(slow))


def cli_once(paths: list[str], extra: list[str]) -> float:
    exe = Path(sys.executable).with_name("kvdiag")
    t0 = time.perf_counter()
    subprocess.run([str(exe), "report", *paths, "--decoder-ttl", "480", "--no-progress", *extra], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def size_mb(files: list[str]) -> float:
    return sum(os.path.getsize(f) for f in files) / 1e6


def run(name: str, paths: list[str], repeat: int) -> dict[str, object]:
    """Interleaved rounds (baseline, then each kvdiag variant, back to back): on a shared machine the
    load changes by the minute, so each round's ratio is the figure; the median over rounds is reported,
    for wall time and for CPU time (DuckDB's CPU counts both of its threads, grep's its own).

    ``name``: events (kvdiag events only), mixed (stock logs beside the events), stock (stock logs only)."""
    files = expand_paths(paths)
    res: dict[str, object] = {"data": name, "files": len(files), "mb": round(size_mb(files), 1)}
    cache = Path(tempfile.mkdtemp(prefix="kvdiag-bench-cache-"))
    rounds: dict[str, list[tuple[float, float]]] = {}
    try:
        res["turns"] = report_once(files, cache_dir=cache)  # fills the cache
        if name == "mixed":
            res["duckdb_path_equals_parser"] = same_table(files)
            res["stock_changes"] = stock_changes(files)
        cli_once(paths, ["--cache-dir", str(cache)])  # fills the config cache too
        variants: list[tuple[str, Callable[[], object]]] = [
            ("duckdb_raw_scan", lambda: duckdb_raw_scan(files)), ("report_cold", lambda: report_once(files))]
        if name == "mixed":  # explain's parser over the same files, for reference (on 1.3M event turns
            # it takes minutes a round: explain's section of BENCHMARKS.md has those figures)
            variants.append(("report_parser", lambda: report_once(files, fast=False)))
        if name == "mixed":
            variants.append(("report_events_only", lambda: report_once(files, events_only=True)))
        variants += [
            ("report_cached", lambda: report_once(files, cache_dir=cache)),
            ("cli_cold", lambda: cli_once(paths, ["--no-cache"])),
            ("cli_cached", lambda: cli_once(paths, ["--cache-dir", str(cache)]))]
        for _ in range(repeat):
            for key, fn in variants:
                rounds.setdefault(key, []).append(timed(fn))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    base = rounds["duckdb_raw_scan"]
    for key, runs in rounds.items():
        res[f"{key}_s"] = round(statistics.median(r[0] for r in runs), 2)
        res[f"{key}_cpu_s"] = round(statistics.median(r[1] for r in runs), 2)
        if key != "duckdb_raw_scan":
            for i, label in ((0, "ratio"), (1, "cpu_ratio")):
                pairs = [r[i] / b[i] for r, b in zip(runs, base, strict=True)]
                res[f"{key}_{label}_median"] = round(statistics.median(pairs), 2)
                res[f"{key}_{label}_range"] = [round(min(pairs), 2), round(max(pairs), 2)]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024, help="Size of the generated event data set.")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvdiag-report-bench")
    ap.add_argument("--reuse", action="store_true", help="Reuse an existing generated data set in --dir.")
    ap.add_argument("--mixed", type=Path, help="Also run over this gen_logs.py data set (stock + events).")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    if not (args.reuse and (args.dir / "router-events.jsonl").exists()):
        t0 = time.perf_counter()
        generate(args.dir, args.size_mb)
        print(f"generated {args.dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), "
                                 f"Python {platform.python_version()}, duckdb {duckdb.__version__}"}))
    print(json.dumps(run("events", [str(args.dir)], args.repeat)))
    if args.mixed:
        print(json.dumps(run("mixed", [str(args.mixed)], args.repeat)))
        stock = [f.path for f in detect(expand_paths([str(args.mixed)])) if f.fmt != "events"]
        print(json.dumps(run("stock", stock, args.repeat)))


if __name__ == "__main__":
    main()
