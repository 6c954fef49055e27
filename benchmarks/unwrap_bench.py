"""What reading logs as clusters store them costs: unwrapping CRI, Docker JSON and kubectl-prefixed files.

Builds ~150 MB of vLLM log and event lines, wraps them each way, and times
kvdiag.diagnostics.container_logs.unwrap_file (best of 3), plus the cost stage_inputs adds to bare
files (a 64 KiB sniff each).

    .venv/bin/python benchmarks/unwrap_bench.py [--lines 400000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvdiag.diagnostics.container_logs import sniff_wrapper, unwrap_file
from kvdiag.diagnostics.sources import stage_inputs

TS = b"2026-11-20T10:00:00.123456789Z"
SAMPLE = [
    b"(EngineCore_DP0 pid=123) DEBUG 11-20 10:00:00 [nixl_connector.py:812] start_load_kv for request "
    b"chatcmpl-0bcc56a3cdac4088abd2dd8465afa8a8-72e6e1d0 from remote engine f72f2603. Num local_block_ids: 114.",
    b"(APIServer pid=99) INFO 11-20 10:00:00 [loggers.py:123] Engine 000: Avg prompt throughput: 2048.0 tokens/s",
    b'{"v":1,"ts":1796121216.375,"source":"router","event":"router_turn","conversation_id":"demo-article-reuse",'
    b'"turn":2,"request_id":"0bcc56a3cdac4088abd2dd8465afa8a8","prompt_tokens":2048,"remote_read_tokens":1824,'
    b'"handle_tokens":1881,"reuse_limit_tokens":1824,"trimmed_tokens":57,"trim_reason":"reasoning_stripped",'
    b'"outcome":"remote_hit","reason":"reported by P","status":"ok"}',
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=400_000)
    args = ap.parse_args()
    lines = [SAMPLE[i % len(SAMPLE)] + b" %d" % i for i in range(args.lines)]
    wrapped = {
        "bare": b"".join(ln + b"\n" for ln in lines),
        "cri": b"".join(TS + b" stderr F " + ln + b"\n" for ln in lines),
        "cri, partial pieces": b"".join(
            (TS + b" stderr P " + ln[:100] + b"\n" + TS + b" stderr F " + ln[100:] + b"\n") if len(ln) > 200
            else TS + b" stderr F " + ln + b"\n" for ln in lines),
        "docker json-file": b"".join(json.dumps({"log": ln.decode() + "\n", "stream": "stderr",
                                                 "time": TS.decode()}).encode() + b"\n" for ln in lines),
        "kubectl --timestamps": b"".join(TS + b" " + ln + b"\n" for ln in lines),
        "kubectl --prefix --timestamps": b"".join(b"[pod/vllm-decode-0/main] " + TS + b" " + ln + b"\n"
                                                  for ln in lines),
    }
    with tempfile.TemporaryDirectory(prefix="kvdiag-unwrap-bench-") as tmp:
        d = Path(tmp)
        print(f"{'format':32s} {'MB':>7s} {'seconds':>8s} {'MB/s':>7s}")
        for name, data in wrapped.items():
            path = d / (name.replace(" ", "_").replace(",", "") + ".log")
            path.write_bytes(data)
            wrapper = sniff_wrapper(data[:65536])
            if wrapper is None:
                best = 1e9
                for _ in range(3):
                    t = time.perf_counter()
                    with stage_inputs([str(path)]) as staged:
                        assert staged.paths == [str(path)]
                    best = min(best, time.perf_counter() - t)
                print(f"{name:32s} {len(data) / 1e6:7.1f} {best:8.4f} {'(read in place: the sniff only)':>7s}")
                continue
            best = 1e9
            for _ in range(3):
                t = time.perf_counter()
                unwrap_file(str(path), wrapper, lambda s, n=path.stem: str(d / f"out-{n}-{s.replace('/', '_')}"),
                            str(path))
                best = min(best, time.perf_counter() - t)
            print(f"{name:32s} {len(data) / 1e6:7.1f} {best:8.2f} {len(data) / 1e6 / best:7.0f}")


if __name__ == "__main__":
    main()
