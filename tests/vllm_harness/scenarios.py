"""Run the real-vLLM connector scenarios in one process and write what happened as JSON.

    python -m vllm_harness.scenarios OUT_DIR      (cwd: tests/)

One process for every scenario keeps the suite cheap (vLLM imports once, ~5 s) and keeps vLLM's
import side effects (CPU affinity pinning, logging config) out of the pytest process. Each
scenario builds its own P and D engines (tests/vllm_harness/engine.py: real Scheduler,
KVDiagNixlConnector in both roles, real NIXL/UCX agents, CPU KV tensors) and records params,
per-block sha256 of sender and receiver, NIXL's own stats and the event files; the tests in
tests/test_connector_vllm.py assert on ``OUT_DIR/results.json``, the events and the log.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_AFFINITY = os.sched_getaffinity(0)

from vllm_harness.engine import BLOCK_SIZE, CpuEngine, write_model_dir  # noqa: E402

TURN1 = list(range(1, 101))           # 100 prompt tokens
DECODE_TOKENS = 40
P_PARAMS_T1 = {"do_remote_decode": True, "do_remote_prefill": False}


def _sha(blobs: list[bytes]) -> list[str]:
    return [hashlib.sha256(b).hexdigest()[:16] for b in blobs]


def _nixl(stats: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = ("bytes_transferred", "transfer_duration", "num_kv_expired_reqs", "num_failed_transfers",
            "num_failed_handshakes")
    return {k: [v for s in stats for v in s.get(k, [])] for k in keys}


class Pair:
    """A P and a D engine plus the driver a router would be: params passed as they are."""

    def __init__(self, work: Path, name: str, *, p_extra: dict[str, Any], d_extra: dict[str, Any],
                 p_prefix_caching: bool = False, p_policy: str = "fail") -> None:
        self.dir = work / name
        self.dir.mkdir(parents=True, exist_ok=True)
        model = write_model_dir(work / "opt")
        self.p = CpuEngine("P", model, work, writer_tag=1, prefix_caching=p_prefix_caching,
                        kv_load_failure_policy=p_policy,
                        extra={**p_extra, "kvdiag_role": "prefill",
                               "kvdiag_events_file": str(self.dir / "prefill-events.jsonl")})
        self.d = CpuEngine("D", model, work, writer_tag=2,
                        extra={**d_extra, "kvdiag_role": "decode",
                               "kvdiag_events_file": str(self.dir / "decode-events.jsonl")})
        os.sched_setaffinity(0, _AFFINITY)
        self.name = name
        self.record: dict[str, Any] = {"p_engine_id": self.p.engine_id, "d_engine_id": self.d.engine_id,
                                       "dir": str(self.dir), "ids": {}}

    def rid(self, label: str) -> str:
        """A request id unique across scenarios (they share one log), shaped like vLLM's."""
        full = f"cmpl-{self.name}-{label}-0"
        self.record["ids"][label] = full
        return full

    def both_until(self, done: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s   # wall clock: a loaded machine slows steps, not this bound
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: did not converge in {timeout_s} s")
            self.p.step()
            self.d.step()
            time.sleep(0.001)

    def prefill(self, label: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
        rid = self.rid(label)
        self.p.add(rid, prompt, max_tokens=1, kv_transfer_params=params)
        self.both_until(lambda: rid in self.p.finished)
        return self.p.finished[rid]

    def decode(self, label: str, prompt: list[int], params: dict[str, Any]) -> Any:
        rid = self.rid(label)
        self.d.add(rid, prompt, max_tokens=DECODE_TOKENS, kv_transfer_params=params)
        self.both_until(lambda: rid in self.d.finished)
        return self.d.finished[rid]

    def turn1(self) -> tuple[list[int], Any, Any]:
        p1 = self.prefill("t1-p", TURN1, dict(P_PARAMS_T1))
        p_blocks = list(p1.kv_transfer_params["remote_block_ids"][0])
        self.record["t1_p_params"] = _jsonable(p1.kv_transfer_params)
        self.record["t1_p_sha"] = _sha(self.p.block_bytes(p_blocks))
        d1 = self.decode("t1-d", TURN1, p1.kv_transfer_params)
        self.record["t1_d_recv_sha"] = _sha(self.d.received.get(self.rid("t1-d"), {}).get("bytes", []))
        self.record["t1_d_params"] = _jsonable(d1.kv_transfer_params)
        history = TURN1 + self.d.tokens[self.rid("t1-d")]
        return history, p1, d1

    def finish(self) -> dict[str, Any]:
        for _ in range(5):
            self.p.step()
            self.d.step()
        for eng in (self.p, self.d):
            if eng.connector is not None:
                eng.connector.kvdiag_flush()
        self.record["p_stats"] = _nixl(self.p.stats)
        self.record["d_stats"] = _nixl(self.d.stats)
        self.record["p_prom_rows"] = [s.get("kvdiag_requests", []) for s in self.p.stats if s.get("kvdiag_requests")]
        self.p.shutdown()
        self.d.shutdown()
        return self.record


def _exposition(eng: CpuEngine) -> dict[str, Any]:
    """Feed the engine's SchedulerStats payloads to vLLM's own KVConnectorProm and KVConnectorLogging,
    as the API server does, and return the /metrics text and the stat-log lines they produce."""
    from prometheus_client import CollectorRegistry, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    registry = CollectorRegistry()

    class _Prom(KVConnectorProm):  # type: ignore[misc]
        # vLLM registers into the process-global registry; a private one keeps this repeatable.
        _gauge_cls = _registered(registry, "Gauge")
        _counter_cls = _registered(registry, "Counter")
        _histogram_cls = _registered(registry, "Histogram")

    prom = _Prom(eng.vllm_config, ["model_name", "engine"], {0: ["opt-test", "0"]})
    logging_ = KVConnectorLogging(eng.vllm_config.kv_transfer_config)
    lines: list[str] = []
    for payload in eng.stats:
        prom.observe(payload, 0)
        logging_.observe(payload)
        logging_.log(lambda fmt, *args: lines.append(fmt % args))
    text = generate_latest(registry).decode()
    return {"metrics": [ln for ln in text.splitlines() if ln.startswith(("kvdiag_", "vllm:nixl_"))],
            "stat_lines": lines, "connector_class": type(prom.prom_metrics).__name__}


def _registered(registry: Any, kind: str) -> Any:
    import prometheus_client

    base = getattr(prometheus_client, kind)

    class Bound(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("registry", registry)
            super().__init__(*args, **kwargs)

    return Bound


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=list)) if obj is not None else None


BIDIR = {"bidirectional_kv_xfer": True}


def s1_two_turn(work: Path) -> dict[str, Any]:
    """P->D on turn 1, D->P readback on turn 2 (byte-checked), P->D again."""
    pair = Pair(work, "s1_two_turn", p_extra=BIDIR, d_extra=BIDIR)
    history, _p1, d1 = pair.turn1()
    d_held = list(d1.kv_transfer_params["remote_block_ids"][0])
    pair.record["t1_d_held_sha"] = _sha(pair.d.block_bytes(d_held))
    prompt2 = history + list(range(3000, 3030))
    p2 = pair.prefill("t2-p", prompt2, d1.kv_transfer_params)
    pair.record["t2_p_params"] = _jsonable(p2.kv_transfer_params)
    got = pair.p.received.get(pair.rid("t2-p"), {})
    pair.record["t2_p_recv_sha"] = _sha(got.get("bytes", []))
    pair.record["t2_p_recv_writers"] = got.get("writers", {})
    pair.decode("t2-d", prompt2, p2.kv_transfer_params)
    pair.record["p_exposition"] = _exposition(pair.p)
    pair.record["d_exposition"] = _exposition(pair.d)
    return pair.finish()


def s2_expired(work: Path) -> dict[str, Any]:
    """decoder_kv_blocks_ttl=2 (below vLLM's 5 s margin): P declines the read; policy fail."""
    pair = Pair(work, "s2_expired", p_extra=BIDIR, d_extra={**BIDIR, "decoder_kv_blocks_ttl": 2})
    history, _p1, d1 = pair.turn1()
    p2 = pair.prefill("t2-p", history + list(range(3000, 3030)), d1.kv_transfer_params)
    pair.record["t2_p_params"] = _jsonable(p2.kv_transfer_params)
    pair.record["t2_p_finish"] = str(p2.finish_reason)
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:  # let D's lease run out so it releases at expiry
        pair.d.step()
        time.sleep(0.05)
    return pair.finish()


def s3_threshold(work: Path) -> dict[str, Any]:
    """P prefix cache on and a high threshold: the remainder is below it, P recomputes."""
    pair = Pair(work, "s3_threshold", p_extra={**BIDIR, "kv_recompute_threshold": 512}, d_extra=BIDIR)
    history, _p1, d1 = pair.turn1()
    p2 = pair.prefill("t2-p", history + list(range(3000, 3030)), d1.kv_transfer_params)
    pair.record["t2_p_params"] = _jsonable(p2.kv_transfer_params)
    # P's notify-only (no READ) frees D's blocks: wait for D to see it (bounded)
    t1_d = pair.rid("t1-d")
    pair.both_until(lambda: t1_d not in pair.d.connector._retained, timeout_s=10.0)
    return pair.finish()


def s4_bidir_off(work: Path) -> dict[str, Any]:
    """bidirectional_kv_xfer off on D: D returns no params and holds nothing."""
    pair = Pair(work, "s4_bidir_off", p_extra=BIDIR, d_extra={})
    _history, _p1, _d1 = pair.turn1()
    return pair.finish()


def _mismatch(work: Path, name: str, exact: bool) -> dict[str, Any]:
    p_extra = BIDIR if exact else {**BIDIR, "kvdiag_pull_matching_prefix": False}   # exact mode is the default
    pair = Pair(work, name, p_extra=p_extra, d_extra=BIDIR)
    history, _p1, d1 = pair.turn1()
    edited = list(history)
    edited[70] = 4999  # the client edited turn 1's history inside block 2
    p2 = pair.prefill("t2-p", edited + list(range(3000, 3030)), d1.kv_transfer_params)
    pair.record["t2_p_params"] = _jsonable(p2.kv_transfer_params)
    got = pair.p.received.get(pair.rid("t2-p"), {})
    pair.record["t2_p_read_blocks"] = len(got.get("blocks", []))
    pair.record["t2_p_recv_sha"] = _sha(got.get("bytes", []))
    pair.record["t1_d_held_sha"] = _sha(pair.d.block_bytes(list(d1.kv_transfer_params["remote_block_ids"][0])))
    pair.record["p_exposition"] = _exposition(pair.p)
    return pair.finish()


def s5_mismatch(work: Path) -> dict[str, Any]:
    """Turn 2 edits turn 1's history, exact mode off: reported as prefix_mismatch, all of D's blocks read."""
    return _mismatch(work, "s5_mismatch", False)


def s6_mismatch_partial(work: Path) -> dict[str, Any]:
    """The same with exact mode (the default): only the matching blocks are read."""
    return _mismatch(work, "s6_mismatch_partial", True)


def s7_handshake_failed(work: Path) -> dict[str, Any]:
    """Turn 2 names an engine id D does not have: NIXL's handshake fails (engine ID mismatch)."""
    pair = Pair(work, "s7_handshake_failed", p_extra=BIDIR, d_extra=BIDIR)
    history, _p1, d1 = pair.turn1()
    bad = {**d1.kv_transfer_params, "remote_engine_id": "00000000-dead-beef-0000-000000000000"}
    p2 = pair.prefill("t2-p", history + list(range(3000, 3030)), bad)
    pair.record["t2_p_params"] = _jsonable(p2.kv_transfer_params)
    pair.record["t2_p_finish"] = str(p2.finish_reason)
    return pair.finish()


def s8_observer_error(work: Path) -> dict[str, Any]:
    """A bug inside the observation: caught, counted, logged; the requests complete unchanged."""
    from kvdiag.schema import prefill_outcome as report

    def broken(self: Any, **_: Any) -> Any:
        raise RuntimeError("injected kvdiag bug")

    original = report.PrefillView.report_dict
    report.PrefillView.report_dict = broken  # type: ignore[method-assign]
    try:
        pair = Pair(work, "s8_observer_error", p_extra=BIDIR, d_extra=BIDIR)
        _history, _p1, d1 = pair.turn1()
        pair.record["guard_errors"] = pair.p.connector.kvdiag_guard.errors
    finally:
        report.PrefillView.report_dict = original  # type: ignore[method-assign]
    pair.record["d_finish"] = str(d1.finish_reason)
    rec = pair.finish()
    rec["p_emit_errors"] = sum(len(s.get("kvdiag_emit_errors", [])) for s in pair.p.stats)
    return rec


def s9_recompute_hang(work: Path) -> dict[str, Any]:
    """vLLM 0.33 with kv_load_failure_policy=recompute: after P declines the expiring read, P's request
    is re-matched but no read is posted, so it never leaves WAITING_FOR_REMOTE_KVS (finding F1).
    Bounded: the request is watched for 2 s, not waited for."""
    pair = Pair(work, "s9_recompute_hang", p_extra=BIDIR, d_extra={**BIDIR, "decoder_kv_blocks_ttl": 2},
                p_policy="recompute")
    history, _p1, d1 = pair.turn1()
    rid = pair.rid("t2-p")
    pair.p.add(rid, history + list(range(3000, 3030)), max_tokens=1, kv_transfer_params=d1.kv_transfer_params)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and rid not in pair.p.finished:
        pair.p.step()
        pair.d.step()
        time.sleep(0.005)
    request = pair.p.scheduler.requests.get(rid)
    pair.record["t2_p_finished"] = rid in pair.p.finished
    pair.record["t2_p_status"] = request.status.name if request is not None else None
    return pair.finish()


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    f.__name__: f for f in (s1_two_turn, s2_expired, s3_threshold, s4_bidir_off, s5_mismatch, s6_mismatch_partial,
                            s7_handshake_failed, s8_observer_error, s9_recompute_hang)
}


def main(out: Path, names: list[str]) -> int:
    import faulthandler

    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging, set_vllm_process_name

    configure_logging(LoggingConfig(log_level="DEBUG"))
    set_vllm_process_name("EngineCore")
    faulthandler.dump_traceback_later(120, repeat=True)  # a hang leaves every thread's stack in the log
    results: dict[str, Any] = {"block_size": BLOCK_SIZE}
    for name in names or list(SCENARIOS):
        started = time.monotonic()
        try:
            results[name] = SCENARIOS[name](out)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = round(time.monotonic() - started, 2)
        # written after every scenario, so a later hang still leaves the earlier results
        (out / "results.partial.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    log = os.open(out_dir / "engine.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.exit(main(out_dir, sys.argv[2:]))
