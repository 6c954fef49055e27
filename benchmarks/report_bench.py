"""`kvdiag report` over ~1 GB of logs against DuckDB's raw scan of the same files (BENCHMARKS.md, issue 13).

Data sets:

* ``mixed`` (``--data DIR``, from ``benchmarks/gen_logs.py --size 1GB``): stock vLLM P/D logs, the proxy
  log and vLLM-benchmark client statistics beside kvdiag's client/router/prefill events;
* ``stock``: the same folder without its event files: what an unmodified deployment leaves (target (a));
* ``events`` (optional, ``--events-dir DIR``): kvdiag event logs only, generated here with
  kvdiag.diagnostics.report_synth when the folder is empty (``--size-mb``).

The baseline is DuckDB reading every record of the same files into a table (``CREATE TABLE AS SELECT *
FROM read_json_auto(...)`` for event files; every other file through ``read_csv``, one column per line).
Variants, timed in interleaved rounds (baseline, then each variant, back to back; on a shared machine the
load changes by the minute, so each round's ratio is the figure and the median over rounds is reported):

* ``report_cold``: the turn table and every aggregation in this process (``load_turn_table`` +
  ``build_report``: the turn table as a pandas DataFrame, as a library user gets it), no cache;
* ``report_arrow_cold``: the same with the table kept in Arrow (``load_turn_arrow`` + ``build_report``: what
  the CLI runs, without pandas);
* ``cli_cold``: ``kvdiag report DIR --no-cache`` as a subprocess: interpreter start, imports, the
  configuration scan and printing included (target (c));
* ``report_cached`` / ``cli_cached``: the same over the Parquet cache (the second run over unchanged logs).

Wall and CPU seconds (this process's threads, DuckDB's included, plus the children's: grep, the CLI).

``--memory DIR`` (e.g. 10 GB from ``gen_logs.py --size 10GB``) also runs ``kvdiag report --no-cache``
once over that folder and once over ``--data``, and reports each child's peak RSS (``wait4``'s
ru_maxrss): the engine streams the files, so 10× the logs must not take 10× the memory (target (e)).

    .venv/bin/python benchmarks/gen_logs.py --size 1GB --out /tmp/bench1g
    .venv/bin/python benchmarks/report_bench.py --data /tmp/bench1g --repeat 3
    .venv/bin/python benchmarks/report_bench.py --data /tmp/bench1g --repeat 5 --stock-only --compare-tree /tmp/before
    .venv/bin/python benchmarks/gen_logs.py --size 10GB --out /tmp/bench10g
    .venv/bin/python benchmarks/report_bench.py --data /tmp/bench1g --repeat 0 --memory /tmp/bench10g
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
from installed_bytecode import compile_package

from kvdiag.diagnostics.detect import detect, expand_paths
from kvdiag.diagnostics.report import build_report, load_turn_arrow, load_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations

BATCH = 4000  # conversations per generator batch (bounded memory)
EVENT_FILES = ("client.jsonl", "router-events.jsonl", "prefill-events.jsonl", "decode-events.jsonl")


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
        detected = detect(files)
        json_files = [f.path for f in detected if f.fmt == "events"]
        other = [f.path for f in detected if f.fmt != "events"]
        if json_files:
            con.execute("CREATE TABLE j AS SELECT * FROM read_json_auto($f, format = 'newline_delimited', "
                        "union_by_name = true)", {"f": json_files})
        if other:
            con.execute("CREATE TABLE t AS SELECT * FROM read_csv($f, columns = {'line': 'VARCHAR'}, header = false, "
                        "delim = chr(1), quote = '', escape = '', strict_mode = false)", {"f": other})
    finally:
        con.close()


def report_once(files: list[str], *, cache_dir: Path | None = None, events_only: bool = False) -> int:
    df = load_turn_table(files, cache_dir=cache_dir, events_only=events_only)
    build_report(df, 480.0)
    return len(df)


def report_arrow_once(files: list[str]) -> int:
    table = load_turn_arrow(files)
    build_report(table, 480.0)
    return int(table.num_rows)


def cli_run(paths: list[str], extra: list[str], tree: Path | None = None) -> dict[str, float]:
    """``kvdiag report`` as a child: wall and CPU seconds and peak RSS (MiB) of that child alone. ``tree``:
    another checkout's code (DIR/kvdiag, e.g. a worktree of an earlier commit), imported as kvdiag through
    PYTHONPATH."""
    exe = Path(sys.executable).with_name("kvdiag")
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
    t0 = time.perf_counter()
    child = subprocess.Popen([str(exe), "report", *paths, "--decoder-ttl", "480", "--no-progress", *extra],
                             stdout=subprocess.DEVNULL, env=env)
    _pid, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"kvdiag report exited with {child.returncode}")
    return {"wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def size_mb(files: list[str]) -> float:
    return sum(os.path.getsize(f) for f in files) / 1e6


def run(name: str, paths: list[str], repeat: int, *, events_only: bool = False, tree: Path | None = None
        ) -> dict[str, object]:
    """Interleaved rounds over one data set; medians over rounds, and each round's ratio to the baseline."""
    files = expand_paths(paths)
    res: dict[str, object] = {"data": name, "files": len(files), "mb": round(size_mb(files), 1)}
    cache = Path(tempfile.mkdtemp(prefix="kvdiag-bench-cache-"))
    rounds: dict[str, list[tuple[float, float]]] = {}
    try:
        res["turns"] = report_once(files, cache_dir=cache)  # fills the cache (and warms the page cache)
        cli_run(paths, ["--cache-dir", str(cache)])  # fills the configuration cache too
        variants: list[tuple[str, Callable[[], object]]] = [
            ("duckdb_raw_scan", lambda: duckdb_raw_scan(files)), ("report_cold", lambda: report_once(files)),
            ("report_arrow_cold", lambda: report_arrow_once(files)),
            ("cli_cold", lambda: cli_run(paths, ["--no-cache"]))]
        if tree is not None:  # the same CLI run with the other tree's code, in the same rounds
            variants.append(("cli_cold_tree", lambda: cli_run(paths, ["--no-cache"], tree)))
        if events_only:
            variants.append(("report_events_only", lambda: report_once(files, events_only=True)))
        variants += [("report_cached", lambda: report_once(files, cache_dir=cache)),
                     ("cli_cached", lambda: cli_run(paths, ["--cache-dir", str(cache)]))]
        for _ in range(repeat):
            for key, fn in variants:
                rounds.setdefault(key, []).append(timed(fn))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if not rounds:
        return res
    base = rounds["duckdb_raw_scan"]
    for key, runs in rounds.items():
        res[f"{key}_s"] = round(statistics.median(r[0] for r in runs), 2)
        res[f"{key}_cpu_s"] = round(statistics.median(r[1] for r in runs), 2)
        if key != "duckdb_raw_scan":
            for i, label in ((0, "ratio"), (1, "cpu_ratio")):
                pairs = [r[i] / b[i] for r, b in zip(runs, base, strict=True)]
                res[f"{key}_{label}_median"] = round(statistics.median(pairs), 2)
                res[f"{key}_{label}_range"] = [round(min(pairs), 2), round(max(pairs), 2)]
    if "cli_cold_tree" in rounds:  # this tree's CLI against the other's, round by round
        pairs = [r[1] / t[1] for r, t in zip(rounds["cli_cold"], rounds["cli_cold_tree"], strict=True)]
        res["cli_cold_over_tree_cpu_median"] = round(statistics.median(pairs), 3)
        res["cli_cold_over_tree_cpu_range"] = [round(min(pairs), 3), round(max(pairs), 3)]
    return res


def memory(big: Path, small: Path) -> dict[str, object]:
    """Peak RSS of ``kvdiag report --no-cache`` over the big and the small folder (one run each)."""
    out: dict[str, object] = {}
    for label, folder in (("small", small), ("big", big)):
        files = expand_paths([str(folder)])
        out[label] = {"dir": str(folder), "mb": round(size_mb(files), 1), **cli_run([str(folder)], ["--no-cache"])}
    small_rss = out["small"]["peak_rss_mib"]  # type: ignore[index]
    big_rss = out["big"]["peak_rss_mib"]  # type: ignore[index]
    out["rss_ratio"] = round(big_rss / small_rss, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="A gen_logs.py data set (stock logs + events).")
    ap.add_argument("--events-dir", type=Path, help="Also run over kvdiag events only (generated here if empty).")
    ap.add_argument("--size-mb", type=int, default=1024, help="Size of the generated event data set.")
    ap.add_argument("--memory", type=Path, help="A large gen_logs.py data set: peak RSS there vs over --data.")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare-tree", type=Path, metavar="DIR",
                    help="Also time the CLI's first run with the kvdiag package under DIR (DIR/kvdiag, e.g. a "
                         "worktree of an earlier commit), in the same rounds (cli_cold_tree).")
    ap.add_argument("--stock-only", action="store_true", help="Skip the mixed set (stock logs alone only).")
    args = ap.parse_args()
    compile_package()  # the CLI child imports kvdiag as an installed one would: from bytecode
    if args.compare_tree is not None:
        compile_package(args.compare_tree)
    print(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), "
                                 f"Python {platform.python_version()}, duckdb {duckdb.__version__}",
                      "load_average": os.getloadavg()}))
    if args.events_dir is not None:
        if not (args.events_dir / "router-events.jsonl").exists():
            t0 = time.perf_counter()
            generate(args.events_dir, args.size_mb)
            print(f"generated {args.events_dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(json.dumps(run("events", [str(args.events_dir)], args.repeat)))
    if args.repeat:
        if not args.stock_only:
            print(json.dumps(run("mixed", [str(args.data)], args.repeat, events_only=True, tree=args.compare_tree)))
        with tempfile.TemporaryDirectory() as tmp:
            stock = Path(tmp)  # the same files without kvdiag's events
            for f in expand_paths([str(args.data)]):
                if Path(f).name not in EVENT_FILES:
                    (stock / Path(f).name).symlink_to(Path(f).resolve())
            print(json.dumps(run("stock", [str(stock)], args.repeat, tree=args.compare_tree)))
            print(json.dumps({"load_average": os.getloadavg()}))
    if args.memory is not None:
        print(json.dumps({"memory": memory(args.memory, args.data), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
