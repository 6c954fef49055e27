"""Scheduler step time with vLLM's NixlConnector vs kvdiag's KVDiagNixlConnector (real vLLM 0.33.0, CPU).

    .venv/bin/python benchmarks/connector_bench.py [--requests 400] [--rounds 5] [--json]

Both runs drive vLLM's real v1 Scheduler (tests/vllm_harness/engine.py: OPT-125m shape, block size
32, prefix caching on) through the same bidirectional P/D workload, as one engine serving both
roles: P requests (``do_remote_decode``, turn 2 carries a D handle so P pulls), D requests
(``do_remote_prefill``, then retention under ``decoder_kv_blocks_ttl``), with the connector
output a worker would report (finished_recving / finished_sending) fed back each step. Only the
connector class differs. Timed: ``schedule()`` + ``update_from_output()`` per step, which is where
every scheduler-side hook of the connector runs. Rounds alternate the two classes; the figure is
the ratio of medians of per-round mean step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_AFFINITY = os.sched_getaffinity(0)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from vllm_harness.engine import BLOCK_SIZE, CONNECTOR, PLAIN_CONNECTOR, Engine, write_model_dir  # noqa: E402

PROMPT = 256
DECODE = 16


def _fake_handle(i: int, tokens: int) -> dict[str, Any]:
    return {"remote_block_ids": [list(range(1, -(-tokens // BLOCK_SIZE) + 1))], "remote_engine_id": "peer-engine",
            "remote_request_id": f"peer-{i}", "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1,
            "remote_num_tokens": tokens}


def run_once(connector: str, requests: int, work: Path) -> dict[str, float]:
    """One pass of the workload; returns mean step seconds and step count."""
    extra = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 64}
    eng = Engine("B", write_model_dir(work / "opt"), work, writer_tag=1, num_blocks=4096, extra=extra,
                 prefix_caching=True, connector=connector, with_worker=False)
    os.sched_setaffinity(0, _AFFINITY)
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    sched = eng.scheduler
    added = 0
    recv_next: set[str] = set()
    recv_reported: set[str] = set()
    send_next: set[str] = set()
    held: list[str] = []
    step_times: list[float] = []
    finished = 0
    for _ in range(requests * 100):   # bounded: a stuck workload fails loudly instead of spinning
        if finished >= requests:
            break
        while added < requests and len(sched.requests) < 64:
            i = added
            prompt = [(7 * i + k) % 50000 + 1 for k in range(PROMPT)]
            if i % 2 == 0:   # P: turn 2 with a D handle (pull), the odd ones are D's
                params = {"do_remote_decode": True, "do_remote_prefill": False, **_fake_handle(i, PROMPT - 16)}
                eng.add(f"p-{i}", prompt, max_tokens=1, kv_transfer_params=params)
            else:
                params = {"do_remote_prefill": True, "do_remote_decode": False, **_fake_handle(i, PROMPT)}
                eng.add(f"d-{i}", prompt, max_tokens=DECODE, kv_transfer_params=params)
            added += 1
        t0 = time.perf_counter()
        so = sched.schedule()
        req_ids = list(so.num_scheduled_tokens)
        kv_out = KVConnectorOutput(finished_sending=set(send_next), finished_recving=set(recv_next))
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)},
                                sampled_token_ids=[[11] for _ in req_ids], kv_connector_output=kv_out)
        outputs = sched.update_from_output(so, mro)
        step_times.append(time.perf_counter() - t0)
        # What the worker would report next step: reads done for waiting requests, blocks sent.
        recv_next = {rid for rid, r in sched.requests.items()
                     if r.status.name == "WAITING_FOR_REMOTE_KVS" and rid not in recv_reported}
        recv_reported |= recv_next
        send_next = set(held[: len(held) // 2 + 1]) if held else set()
        held = [r for r in held if r not in send_next]
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    finished += 1
                    if out.kv_transfer_params is not None:
                        held.append(out.request_id)
    else:
        raise RuntimeError(f"{connector}: only {finished}/{requests} requests finished")
    eng.shutdown()
    return {"mean_step_s": statistics.fmean(step_times), "steps": float(len(step_times))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvdiag-connector-bench-"))
    results: dict[str, list[float]] = {PLAIN_CONNECTOR: [], CONNECTOR: []}
    steps: dict[str, float] = {}
    run_once(PLAIN_CONNECTOR, 20, work)   # warm-up: imports, first-call caches
    for _ in range(args.rounds):
        for name in (PLAIN_CONNECTOR, CONNECTOR):
            r = run_once(name, args.requests, work)
            results[name].append(r["mean_step_s"])
            steps[name] = r["steps"]
    plain = statistics.median(results[PLAIN_CONNECTOR])
    kvdiag = statistics.median(results[CONNECTOR])
    summary = {"requests": args.requests, "rounds": args.rounds, "steps_per_round": steps,
               "plain_step_ms": round(plain * 1e3, 4), "kvdiag_step_ms": round(kvdiag * 1e3, 4),
               "overhead_pct": round((kvdiag / plain - 1.0) * 100.0, 2),
               "per_round_ms": {k: [round(v * 1e3, 4) for v in vs] for k, vs in results.items()}}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"requests={args.requests} rounds={args.rounds} steps/round={steps}")
        print(f"NixlConnector        mean step {summary['plain_step_ms']:.4f} ms")
        print(f"KVDiagNixlConnector  mean step {summary['kvdiag_step_ms']:.4f} ms")
        print(f"overhead {summary['overhead_pct']:+.2f}% of step time")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
