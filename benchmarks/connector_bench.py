"""Scheduler step time with vLLM's NixlConnector vs kvdiag's KVDiagNixlConnector (real vLLM 0.33.0, CPU).

    .venv/bin/python benchmarks/connector_bench.py [--requests 400] [--rounds 5] [--json]
        [--mismatch-every 4] [--kvdiag-extra '{"kvdiag_pull_matching_prefix": false}']

Both runs drive vLLM's real v1 Scheduler (tests/vllm_harness/engine.py: OPT-125m shape, block size
32, prefix caching on) through the same bidirectional P/D workload, as one engine serving both
roles: P requests (``do_remote_decode``, turn 2 carries a D handle so P pulls; the handle carries
the block-hash digest a kvdiag D returns, and every ``--mismatch-every``-th one diverges from the
prompt in block 3, so exact mode shrinks it), D requests (``do_remote_prefill``, then retention
under ``decoder_kv_blocks_ttl``), with the connector output a worker would report
(finished_recving / finished_sending) fed back each step. Only the connector class differs.
Timed: ``schedule()`` + ``update_from_output()`` per step, which is where every scheduler-side
hook of the connector runs. Both engines run in lockstep in one process, step
i of each doing the same work, so the machine's load hits both sides of each pair alike; the figure
is the median of the pairwise step-time ratios (and the per-round means for reference).
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

from vllm_harness.engine import BLOCK_SIZE, CONNECTOR, PLAIN_CONNECTOR, CpuEngine, write_model_dir  # noqa: E402

PROMPT = 256
DECODE = 16


def _fake_handle(i: int, tokens: int) -> dict[str, Any]:
    return {"remote_block_ids": [list(range(1, -(-tokens // BLOCK_SIZE) + 1))], "remote_engine_id": "peer-engine",
            "remote_request_id": f"peer-{i}", "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1,
            "remote_num_tokens": tokens}


def _digest(eng: CpuEngine, prompt: list[int], tokens: int, diverge: bool) -> dict[str, Any]:
    """The kvdiag_digest a D holding ``tokens`` tokens of this sequence returns (``diverge``: block 3 edited)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvdiag.schema.prefix_digest import make_digest

    held = list(prompt[:tokens])
    if diverge:
        held[3 * BLOCK_SIZE + 5] = 1
    req = Request(request_id="digest", prompt_token_ids=held, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None, block_hasher=eng.block_hasher)
    full = tokens // BLOCK_SIZE
    try:
        return dict(make_digest(req.block_hashes, BLOCK_SIZE, full, held[full * BLOCK_SIZE:tokens]))
    except TypeError:   # a connector from before the end checkpoint (comparing with an older commit)
        return dict(make_digest(req.block_hashes, BLOCK_SIZE, full))


class Driver:
    """One engine (one connector class) and its copy of the workload, stepped on demand."""

    def __init__(self, connector: str, requests: int, work: Path, events: bool = False, mismatch_every: int = 4,
                 kvdiag_extra: dict[str, Any] | None = None) -> None:
        extra: dict[str, Any] = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 64}
        if connector == CONNECTOR:
            extra.update(kvdiag_extra or {})
            if events:
                extra["kvdiag_events_file"] = str(work / "events.jsonl")
        self.eng = CpuEngine("B", write_model_dir(work / "opt"), work, writer_tag=1, num_blocks=4096, extra=extra,
                          prefix_caching=True, connector=connector, with_worker=False)
        os.sched_setaffinity(0, _AFFINITY)
        self.requests = requests
        self.mismatch_every = mismatch_every
        self.added = self.finished = 0
        self.recv_next: set[str] = set()
        self.recv_reported: set[str] = set()
        self.send_next: set[str] = set()
        self.held: list[str] = []
        self.step_times: list[float] = []   # wall clock (perf_counter)
        self.step_cpu: list[float] = []     # this thread's CPU time: blind to preemption by other processes

    @property
    def done(self) -> bool:
        return self.finished >= self.requests

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.eng.scheduler
        while self.added < self.requests and len(sched.requests) < 64:
            i = self.added
            prompt = [(7 * i + k) % 50000 + 1 for k in range(PROMPT)]
            if i % 2 == 0:   # P: turn 2 with a D handle (pull), the odd ones are D's
                diverge = self.mismatch_every > 0 and (i // 2) % self.mismatch_every == 0
                params = {"do_remote_decode": True, "do_remote_prefill": False, **_fake_handle(i, PROMPT - 16),
                          "kvdiag_digest": _digest(self.eng, prompt, PROMPT - 16, diverge)}
                self.eng.add(f"p-{i}", prompt, max_tokens=1, kv_transfer_params=params)
            else:
                params = {"do_remote_prefill": True, "do_remote_decode": False, **_fake_handle(i, PROMPT)}
                self.eng.add(f"d-{i}", prompt, max_tokens=DECODE, kv_transfer_params=params)
            self.added += 1
        c0, t0 = time.thread_time(), time.perf_counter()
        so = sched.schedule()
        req_ids = list(so.num_scheduled_tokens)
        kv_out = KVConnectorOutput(finished_sending=set(self.send_next), finished_recving=set(self.recv_next))
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)},
                                sampled_token_ids=[[11] for _ in req_ids], kv_connector_output=kv_out)
        outputs = sched.update_from_output(so, mro)
        self.step_times.append(time.perf_counter() - t0)
        self.step_cpu.append(time.thread_time() - c0)
        # What the worker would report next step: reads done for waiting requests (once), blocks sent.
        self.recv_next = {rid for rid, r in sched.requests.items()
                          if r.status.name == "WAITING_FOR_REMOTE_KVS" and rid not in self.recv_reported}
        self.recv_reported |= self.recv_next
        self.send_next = set(self.held[: len(self.held) // 2 + 1]) if self.held else set()
        self.held = [r for r in self.held if r not in self.send_next]
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    self.finished += 1
                    if out.kv_transfer_params is not None:
                        self.held.append(out.request_id)


def run_pair(requests: int, work: Path, freeze: bool = True, events: bool = False, mismatch_every: int = 4,
             kvdiag_extra: dict[str, Any] | None = None) -> dict[str, dict[str, list[float]]]:
    """Both connectors in lockstep, step for step (alternating who goes first): the machine's load
    hits both sides of each comparison alike."""
    from vllm.utils.gc_utils import freeze_gc_heap

    plain = Driver(PLAIN_CONNECTOR, requests, work, mismatch_every=mismatch_every)
    kvdiag = Driver(CONNECTOR, requests, work, events, mismatch_every, kvdiag_extra)
    if freeze:
        freeze_gc_heap()   # as vLLM's EngineCore does after init: static objects leave the GC's scans
    for n in range(requests * 100):   # bounded: a stuck workload fails loudly instead of spinning
        if plain.done and kvdiag.done:
            break
        for drv in ((plain, kvdiag) if n % 2 == 0 else (kvdiag, plain)):
            if not drv.done:
                drv.step()
    else:
        raise RuntimeError(f"only {plain.finished}/{kvdiag.finished} of {requests} requests finished")
    plain.eng.shutdown()
    kvdiag.eng.shutdown()
    return {"wall": {PLAIN_CONNECTOR: plain.step_times, CONNECTOR: kvdiag.step_times},
            "cpu": {PLAIN_CONNECTOR: plain.step_cpu, CONNECTOR: kvdiag.step_cpu}}


def _figures(rounds: list[dict[str, list[float]]], requests: int, steps: int,
             forward_ms: list[float]) -> dict[str, Any]:
    """Overhead figures from per-step times of both connectors, round by round (one clock)."""
    ratios: list[float] = []
    means: dict[str, list[float]] = {PLAIN_CONNECTOR: [], CONNECTOR: []}
    for times in rounds:
        # step i of both runs did the same work: compare them pairwise
        ratios.extend(k / p for p, k in zip(times[PLAIN_CONNECTOR], times[CONNECTOR], strict=False) if p > 0)
        for name, ts in times.items():
            means[name].append(sum(ts) / len(ts))
    plain, kvdiag = statistics.median(means[PLAIN_CONNECTOR]), statistics.median(means[CONNECTOR])
    # Absolute cost per step: the median over rounds of the round's mean difference. (The median of the
    # pairwise differences would understate it: most steps finish no request, where the per-request
    # hooks do not run.)
    added = statistics.median(k - p for p, k in zip(means[PLAIN_CONNECTOR], means[CONNECTOR], strict=True))
    return {"plain_step_ms": round(plain * 1e3, 4), "kvdiag_step_ms": round(kvdiag * 1e3, 4),
            "overhead_pct_of_means": round((kvdiag / plain - 1.0) * 100.0, 2),
            "overhead_pct_median_pairwise": round((statistics.median(ratios) - 1.0) * 100.0, 2),
            "added_us_per_step": round(added * 1e6, 2),
            "per_request_us": round(added * steps / requests * 1e6, 2),
            # the same absolute cost against a step that also runs the model forward
            "pct_of_step_with_forward_ms": {f"{ms:g}": round(added / (plain + ms / 1e3) * 100.0, 3)
                                            for ms in forward_ms},
            "per_round_ms": {k: [round(v * 1e3, 4) for v in vs] for k, vs in means.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[4.0, 90.0],
                        help="assumed model-forward time(s) of a real step, for the share-of-step figure")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="skip vLLM's post-init gc freeze (freeze_gc_heap), which EngineCore does")
    parser.add_argument("--events", action="store_true",
                        help="give the kvdiag connector an events file (JSON is written on the sink's thread)")
    parser.add_argument("--mismatch-every", type=int, default=4,
                        help="every N-th P handle's digest diverges from the prompt (0: none)")
    parser.add_argument("--kvdiag-extra", type=json.loads, default={},
                        help="extra kv_connector_extra_config for the kvdiag connector, as JSON")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvdiag-connector-bench-"))
    freeze = not args.no_gc_freeze
    opts = {"events": args.events, "mismatch_every": args.mismatch_every, "kvdiag_extra": args.kvdiag_extra}
    run_pair(20, work, freeze, **opts)   # warm-up: imports, first-call caches
    rounds = [run_pair(args.requests, work, freeze, **opts) for _ in range(args.rounds)]
    steps = len(rounds[-1]["wall"][CONNECTOR])
    summary: dict[str, Any] = {"requests": args.requests, "rounds": args.rounds, "steps_per_round": steps,
                               "gc_freeze": freeze, "forward_ms": args.forward_ms, **opts}
    for clock in ("cpu", "wall"):
        summary[clock] = _figures([r[clock] for r in rounds], args.requests, steps, args.forward_ms)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"requests={args.requests} rounds={args.rounds} steps/round={steps} gc_freeze={freeze} "
          f"events={args.events} mismatch_every={args.mismatch_every} kvdiag_extra={args.kvdiag_extra}")
    for clock, label in (("cpu", "thread CPU time"), ("wall", "wall clock")):
        f = summary[clock]
        print(f"[{label}] NixlConnector {f['plain_step_ms']:.4f} ms/step, KVDiagNixlConnector "
              f"{f['kvdiag_step_ms']:.4f} ms/step (medians of round means)")
        print(f"  bare scheduler step: {f['overhead_pct_median_pairwise']:+.2f}% (median of pairwise ratios), "
              f"{f['overhead_pct_of_means']:+.2f}% (ratio of means); added {f['added_us_per_step']} us per step, "
              f"{f['per_request_us']} us per request")
        for ms, pct in f["pct_of_step_with_forward_ms"].items():
            print(f"  share of a step with a {ms} ms model forward: {pct:.3f}% (target <= 1%: "
                  f"{'met' if pct <= 1.0 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
