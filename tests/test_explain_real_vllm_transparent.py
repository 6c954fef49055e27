"""kvdiag's connector is invisible to a stock proxy and a stock D on real vLLM 0.33 (issue 12, item 4).

The reference proxy's flow (tests/test_explain_instrumentation_transparent.py, step by step) runs twice
against the real-engine testbed (vLLM's Scheduler, NIXL on CPU): once with vLLM's own
``NixlConnector`` on P and D, once with ``KVDiagNixlConnector``. Two conversations each, after one
that pays for P's first NIXL handshake: one whose second read succeeds, one whose second turn comes after
D's blocks are inside vLLM's 5 s expiry margin (D's TTL 10 s, 6.5 s gap), so P declines the read and its
API server answers HTTP 500. Every status, every ``kv_transfer_params`` and every error object a stock
consumer acts on has the same shape both ways (kvdiag's keys only inside dicts the consumers read by key).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_explain_instrumentation_transparent import MODEL, _compare, _proxy_turn
from vllm_harness.testbed import attempt_dirs, run_retrying_handshake

from kvdiag.demo.processes import Component

pytestmark = pytest.mark.vllm

# (a TTL of 8 s left the back-to-back read 3 s before vLLM's 5 s margin, and a loaded machine's first NIXL
# handshake took nearly that: P declined the read that should succeed in one fresh-clone run)
D_TTL_S = 10.0
LATE_GAP_S = 6.5  # D's deadline is then 3.5 s away when P reads: declined
READY_S = 120.0
STOCK_ERROR = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}


def _engine(out: Path, role: str, connector: str, extra: list[str]) -> Component:
    ready = out / f".{role}.ready"
    argv = [sys.executable, "-m", "kvdiag.sim.vllm_backend", role, "--port", "0", "--model", MODEL,
            "--connector", connector, "--no-prefix-caching", "--log-file", str(out / f"{role}.log"),
            "--ready-file", str(ready), *extra]
    console = out / f"{role}.console.txt"
    fh = console.open("ab")
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return Component(name=role, argv=argv, process=process, console=console, ready_file=ready, _console_fh=fh)


async def _conversation(session: aiohttp.ClientSession, p: str, d: str, tag: str, gap_s: float
                        ) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": f"Plan a three-day trip to Kyoto for a family ({tag})."}]
    first = await _proxy_turn(session, p, d, messages, None, f"{tag}-t1")
    messages += [{"role": "assistant", "content": first["reply"]},
                 {"role": "user", "content": "Swap day two for a day in Nara."}]
    await asyncio.sleep(gap_s)
    return [first, await _proxy_turn(session, p, d, messages, first["d_params"], f"{tag}-t2")]


async def _flow(p: str, d: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        # P's first read from D starts the NIXL handshake, which took 7 s on a loaded machine: a back-to-back
        # read was then inside D's expiry margin and declined. A first conversation, not compared, pays for it.
        await _conversation(session, p, d, "warm", 0.0)
        return [*await _conversation(session, p, d, "ok", 0.0), *await _conversation(session, p, d, "late",
                                                                                     LATE_GAP_S)]


def _run_both(out: Path, connector: str) -> list[dict[str, Any]]:
    """The flow against P and D with ``connector``, started in ``out``."""
    comps = [_engine(out, "prefill", connector, []),
             _engine(out, "decode", connector, ["--decoder-kv-blocks-ttl", f"{D_TTL_S:g}"])]
    try:
        for comp in comps:
            comp.wait_ready(READY_S)
        return asyncio.run(_flow(comps[0].url, comps[1].url))
    finally:
        for comp in comps:
            comp.stop()


def _retried(parent: Path, connector: str) -> list[dict[str, Any]]:
    """_run_both, once more in a new folder when vLLM missed its own 5 s handshake answer (a loaded machine):
    that run's turns are not the planned ones."""
    got: list[list[dict[str, Any]]] = []
    run_retrying_handshake(attempt_dirs(parent), lambda out: got.append(_run_both(out, connector)))
    return got[-1]


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[dict[str, Any]]]]:
    yield {c: _retried(tmp_path_factory.mktemp(f"transparent-vllm-{c}"), c) for c in ("nixl", "kvdiag")}


def test_the_stock_flow_sees_the_same_shapes_with_the_real_connector(
        both_ways: dict[str, list[dict[str, Any]]]) -> None:
    stock, instrumented = both_ways["nixl"], both_ways["kvdiag"]
    assert _compare(stock, instrumented) == []
    for run in (stock, instrumented):
        ok_t2, late_t2 = run[1], run[3]
        assert ok_t2["p_status"] == 200 and ok_t2["p_params"] and ok_t2["d_status"] == 200, ok_t2
        # the declined read: vLLM 0.33's GenerationError, no params, nothing else in the error object
        assert late_t2["p_status"] == 500 and late_t2["p_params"] is None and late_t2["p_error"] == STOCK_ERROR
    assert "kvdiag" in instrumented[1]["p_params"] and "kvdiag" not in stock[1]["p_params"]
    assert "kvdiag_digest" in instrumented[0]["d_params"] and "kvdiag_digest" not in stock[0]["d_params"]
