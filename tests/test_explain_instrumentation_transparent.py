"""kvdiag's instrumentation must be invisible to a stock proxy and a stock D (issue 12, item 4).

The stock flow is run both ways, sim engines in stock mode and in instrumented mode, through the
reference proxy's handling of the params (``disagg_proxy_multiturn.py``, followed here step by step:
P's params go to D only ``if p_kv_params``; D's final-chunk params are stored and sent to P next
turn). Every response and every ``kv_transfer_params`` a stock consumer acts on must have the stock
shape: null stays null, and extra keys only inside a dict the consumer reads by key (vLLM's NIXL
connector reads only the keys it knows).

After a failed D->P read (here a handshake failure) vLLM 0.33's API server answers P's request with
HTTP 500 and its error object; the reference proxy's ``raise_for_status`` ends the turn there, in both
modes. Instrumented, P's outcome rides in that error object (which the proxy never reads, and where
kvdiag's router looks for it) and in P's prefill event; a null ``kv_transfer_params`` stays null.
Before, the sim's instrumented P turned the failed request's null params into ``{"kvdiag": ...}``,
and the proxy then sent D other params than stock (``test_the_comparison_catches_a_null_that_became_a_dict``
is that difference). The real connector adds its report only to params that are not null; the same
flow on real vLLM 0.33 with and without it is tests/test_explain_real_vllm_transparent.py.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvdiag.demo.processes import Component
from kvdiag.demo.scenarios import admin_post
from kvdiag.sim.pd_driver import read_sse

MODEL = "Qwen/Qwen3-8B"
MISS_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
EXTRA_KEYS = frozenset({"kvdiag", "kvdiag_digest"})  # inside a dict only: the connector ignores them


def _engines(out: Path, mode: str) -> dict[str, Component]:
    comps: dict[str, Component] = {}
    for role in ("prefill", "decode"):
        comps[role] = Component.launch(f"{role}-{mode}", [
            "sim", role, "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--mode", mode, "--time-scale",
            "0.02", "--block-size", "16", "--kv-recompute-threshold", "64", "--no-prefix-caching",  # the article's P
            "--log-file", str(out / f"{role}.log")],
            out)
    for comp in comps.values():
        comp.wait_ready()
    return comps


async def _proxy_turn(session: aiohttp.ClientSession, p: str, d: str, messages: list[dict[str, Any]],
                      cached: dict[str, Any] | None, rid: str) -> dict[str, Any]:
    """One turn as the reference proxy handles it; returns what each consumer was handed."""
    req: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 96, "stream": True}
    if cached:
        sent = copy.deepcopy(cached)
        sent["do_remote_decode"], sent["do_remote_prefill"] = True, False
        req["kv_transfer_params"] = sent
    else:
        req["kv_transfer_params"] = dict(MISS_PARAMS)
    p_req = {**req, "stream": False, "max_tokens": 1}
    async with session.post(f"{p}/v1/chat/completions", json=p_req, headers={"X-Request-Id": rid}) as resp:
        p_status = resp.status
        p_body = await resp.json()
    seen: dict[str, Any] = {"p_status": p_status, "p_params": p_body.get("kv_transfer_params"),
                            "p_error": p_body.get("error")}
    if p_status != 200:  # the proxy's raise_for_status: the turn ends with P's error
        return seen
    p_kv = p_body.get("kv_transfer_params", {})
    if p_kv:  # the proxy's own test: a null (or empty) answer leaves the request as it was
        p_kv["remote_host"] = "127.0.0.1"
        req["kv_transfer_params"] = p_kv
    seen["d_request_params"] = copy.deepcopy(req["kv_transfer_params"])
    async with session.post(f"{d}/v1/chat/completions", json=req, headers={"X-Request-Id": rid}) as resp:
        seen["d_status"] = resp.status
        chunks = await read_sse(resp)
    seen["reply"] = "".join((c.get("choices") or [{}])[0].get("delta", {}).get("content") or "" for c in chunks)
    stored = [c["kv_transfer_params"] for c in chunks if c.get("kv_transfer_params")]
    seen["d_params"] = stored[-1] if stored else None
    return seen


async def _flow(comps: dict[str, Component], fail_second_read: bool) -> list[dict[str, Any]]:
    p, d = comps["prefill"].url, comps["decode"].url
    steps = []
    async with aiohttp.ClientSession() as session:
        messages = [{"role": "user", "content": "Plan a three-day trip to Kyoto for a family with two children."}]
        first = await _proxy_turn(session, p, d, messages, None, "transparent-t1")
        steps.append(first)
        messages += [{"role": "assistant", "content": first["reply"]},
                     {"role": "user", "content": "Swap day two for a day in Nara."}]
        if fail_second_read:
            await admin_post(session, p, "/kvdiag/admin/faults", {"fail_transfers": {"handshake_failed": 1.0}})
        steps.append(await _proxy_turn(session, p, d, messages, first["d_params"], "transparent-t2"))
    return steps


def _shape(value: Any) -> Any:
    """What a stock consumer's decisions depend on: null-or-empty vs a dict, and the dict's stock keys."""
    if not value:
        return None
    if isinstance(value, dict):
        return sorted(k for k in value if k not in EXTRA_KEYS)
    return type(value).__name__


@pytest.fixture(scope="module", params=[False, True], ids=["reads-ok", "second-read-fails"])
def both_ways(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    runs = []
    for mode in ("stock", "instrumented"):
        out = tmp_path_factory.mktemp(f"transparent-{mode}")
        comps = _engines(out, mode)
        try:
            runs.append(asyncio.run(_flow(comps, fail_second_read=request.param)))
        finally:
            for comp in comps.values():
                comp.stop()
    yield runs[0], runs[1]


def _compare(stock: list[dict[str, Any]], instrumented: list[dict[str, Any]]) -> list[str]:
    diffs = []
    for turn, (a, b) in enumerate(zip(stock, instrumented, strict=True), start=1):
        for key in ("p_status", "d_status"):
            if a.get(key) != b.get(key):
                diffs.append(f"turn {turn} {key}: stock {a.get(key)}, instrumented {b.get(key)}")
        for key in ("p_params", "p_error", "d_request_params", "d_params"):
            if _shape(a.get(key)) != _shape(b.get(key)):
                diffs.append(f"turn {turn} {key}: stock {_shape(a.get(key))}, instrumented {_shape(b.get(key))}")
    return diffs


def test_the_stock_flow_sees_the_same_shapes_both_ways(
        both_ways: tuple[list[dict[str, Any]], list[dict[str, Any]]], request: pytest.FixtureRequest) -> None:
    stock, instrumented = both_ways
    assert _compare(stock, instrumented) == []
    assert all(turn["p_status"] in (200, 500) for turn in (*stock, *instrumented))
    if "second-read-fails" in request.node.callspec.id:
        # the failed read: vLLM 0.33's 500, no params; instrumented, P's verdict in the error object only
        assert stock[1]["p_status"] == instrumented[1]["p_status"] == 500
        assert stock[1]["p_params"] is None and instrumented[1]["p_params"] is None
        assert "kvdiag" not in stock[1]["p_error"]
        assert instrumented[1]["p_error"]["kvdiag"]["outcome"] == "transfer_failed"
    else:
        assert [t["p_status"] for t in stock] == [200, 200] and stock[1]["p_params"]
        assert "kvdiag" in instrumented[1]["p_params"]  # the report rides inside params that exist


def test_the_comparison_catches_a_null_that_became_a_dict() -> None:
    # negative control for _compare: exactly the difference the failing case has
    stock = [{"p_status": 200, "p_params": None, "d_request_params": {"remote_block_ids": [[1]]}}]
    instrumented = [{"p_status": 200, "p_params": {"kvdiag": {}}, "d_request_params": {"kvdiag": {}}}]
    assert _compare(stock, instrumented) == [
        "turn 1 p_params: stock None, instrumented []",
        "turn 1 d_request_params: stock ['remote_block_ids'], instrumented []"]
