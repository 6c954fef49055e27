"""``kvdiag check`` against the emulated cluster: a healthy one passes, each misconfiguration is named.

Every scenario starts the real emulated P and D and the real router on loopback with one switch
turned, runs the check, and asserts the exact set of failed checks: the healthy runs are the
negative control of the misconfigured ones, and each misconfigured run of the healthy one.
"""

from __future__ import annotations

from typing import Any

import pytest
from check_support import gateway, sim_cluster

from kvdiag.check.findings import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, CheckReport, Status
from kvdiag.check.run import CheckOptions, run_check

pytestmark = pytest.mark.timeout(120)

CORE = ("models", "pd_handoff", "stream_kv_params", "bidirectional_decode", "bidirectional_prefill", "d2p_read",
        "block_size", "decode_ttl", "router_ttl", "router_decode_ttl", "conversation_id", "router_state",
        "request_ids", "clocks", "prefill_reachable", "decode_reachable", "router_reachable")


def _failed(report: CheckReport) -> set[str]:
    return {f.id for f in report.failed()}


def _status(report: CheckReport, check_id: str) -> Status:
    found = report.get(check_id)
    assert found is not None, f"{check_id} missing from {[f.id for f in report.findings]}"
    return found.status


async def _check(urls: dict[str, str], **kw: Any) -> CheckReport:
    return await run_check(CheckOptions(**{**urls, **kw}))


@pytest.mark.parametrize("mode", ["stock", "instrumented"])
async def test_healthy_cluster_passes_every_check(mode: str) -> None:
    async with sim_cluster(p={"mode": mode}, d={"mode": mode}) as cluster:
        report = await _check(cluster.urls)
    assert _failed(report) == set(), [f.to_json_dict() for f in report.failed()]
    for check_id in CORE:
        assert _status(report, check_id) is Status.PASS, report.get(check_id)
    assert _status(report, "prefix_caching_prefill") is Status.INFO
    assert report.exit_code() == EXIT_OK and report.exit_code(strict=True) == EXIT_OK
    assert "16-token" in report.get("block_size").detail  # type: ignore[union-attr]
    assert "about 480 s" in report.get("decode_ttl").detail  # type: ignore[union-attr]


async def test_prefix_caching_off_is_reported_and_reads_the_whole_history() -> None:
    async with sim_cluster(p={"prefix_caching": False}) as cluster:
        report = await _check(cluster.urls)
    assert _failed(report) == set()
    caching = report.get("prefix_caching_prefill")
    assert caching is not None and caching.status is Status.INFO and caching.detail.startswith("off")


SCENARIOS: list[tuple[str, dict[str, Any], set[str], str]] = [
    # (name, cluster switches, the checks that must fail, a phrase the first one's detail must contain)
    ("P --no-bidirectional", {"p": {"bidirectional_kv_xfer": False}}, {"bidirectional_prefill"},
     "P ignored D's handle"),
    ("P --no-bidirectional, instrumented", {"p": {"bidirectional_kv_xfer": False, "mode": "instrumented"}},
     {"bidirectional_prefill"}, "bidirectional_kv_xfer is off on P"),
    ("D --no-bidirectional", {"d": {"bidirectional_kv_xfer": False}}, {"bidirectional_decode"},
     "returned kv_transfer_params None"),
    ("D --no-stream-kv-params", {"d": {"stream_kv_params": False}}, {"stream_kv_params"},
     "has no kv_transfer_params"),
    ("router --entry-ttl 478 (D 480)", {"router": {"entry_ttl": 478.0}}, {"router_ttl"},
     "entry TTL 478 s is not below"),
    ("router's copy 480 s, D's real TTL 60 s", {"d": {"decoder_kv_blocks_ttl": 60.0}},
     {"router_decode_ttl", "router_ttl"}, "D keeps them about 60 s"),
    ("D's TTL 5 s (never works)", {"d": {"decoder_kv_blocks_ttl": 5.0},
                                   "router": {"decoder_kv_blocks_ttl": 5.0, "entry_ttl": 2.0}},
     {"decode_ttl", "d2p_read", "router_ttl"}, "not above P's 5 s expiry margin"),
    # D cannot load P's 32-token blocks into its 16-token layout: the handoff fails too, and says why.
    ("P 32-token blocks, D 16", {"p": {"block_size": 32}}, {"block_size", "pd_handoff"},
     "P uses 32-token blocks, D 16"),
    ("P and D serve different models", {"p": {"model": "org/model-a"}}, {"models"}, "no model in common"),
    ("P's NIXL reads fail (handshake)", {"p": {"fail_transfers": {"handshake_failed": 1.0}}}, {"d2p_read"},
     "NIXL read from D failed"),
    ("P's NIXL reads fail, instrumented", {"p": {"fail_transfers": {"transfer_failed": 1.0},
                                                 "mode": "instrumented"}}, {"d2p_read"}, "(transfer_failed)"),
]


@pytest.mark.parametrize(("name", "switches", "expected", "phrase"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
async def test_each_misconfiguration_is_named(name: str, switches: dict[str, Any], expected: set[str],
                                              phrase: str) -> None:
    async with sim_cluster(**switches) as cluster:
        report = await _check(cluster.urls)
    assert _failed(report) == expected, [f.to_json_dict() for f in report.failed()]
    details = " | ".join(report.get(c).detail for c in sorted(expected))  # type: ignore[union-attr]
    assert phrase in details
    assert all(report.get(c).fix for c in expected)  # type: ignore[union-attr]
    assert report.exit_code() == EXIT_FAILED
    if "pd_handoff" in expected:
        assert "block sizes differ" in report.get("pd_handoff").detail  # type: ignore[union-attr]


async def test_a_gateway_dropping_the_conversation_id_is_named() -> None:
    async with sim_cluster() as cluster, gateway(cluster.router.url, drop_conversation_id=True) as gw:
        report = await _check({**cluster.urls, "router": gw.url})
    assert _failed(report) == {"conversation_id"}
    assert "drops it" in report.get("conversation_id").detail  # type: ignore[union-attr]
    assert _status(report, "router_state") is Status.SKIPPED


async def test_a_skewed_clock_is_named() -> None:
    async with sim_cluster() as cluster, gateway(cluster.router.url, clock_offset_s=30.0) as gw:
        report = await _check({**cluster.urls, "router": gw.url})
    assert _failed(report) == {"clocks"}
    assert "router off by more than 2 s" in report.get("clocks").detail  # type: ignore[union-attr]
    async with sim_cluster() as cluster, gateway(cluster.router.url, clock_offset_s=0.0) as gw:
        control = await _check({**cluster.urls, "router": gw.url})
    assert _failed(control) == set()


ROUTER_ONLY: list[tuple[str, dict[str, Any], str]] = [
    ("D --no-stream-kv-params", {"d": {"stream_kv_params": False}}, "stream_kv_params"),
    ("D --no-bidirectional", {"d": {"bidirectional_kv_xfer": False}}, "bidirectional_decode"),
    ("P --no-bidirectional, instrumented", {"p": {"bidirectional_kv_xfer": False, "mode": "instrumented"}},
     "bidirectional_prefill"),
    ("P's reads fail, instrumented", {"p": {"fail_transfers": {"handshake_failed": 1.0}, "mode": "instrumented"}},
     "d2p_read"),
    ("router --entry-ttl 478", {"router": {"entry_ttl": 478.0}}, "router_ttl"),
]


@pytest.mark.parametrize(("name", "switches", "expected"), ROUTER_ONLY, ids=[s[0] for s in ROUTER_ONLY])
async def test_router_only_names_what_the_router_sees(name: str, switches: dict[str, Any], expected: str) -> None:
    async with sim_cluster(**switches) as cluster:
        report = await _check({"router": cluster.router.url})
    assert _failed(report) == {expected}, [f.to_json_dict() for f in report.failed()]
    assert _status(report, "models") is Status.SKIPPED


async def test_router_only_healthy_instrumented_passes_and_stock_cannot_tell() -> None:
    async with sim_cluster(p={"mode": "instrumented"}) as cluster:
        report = await _check({"router": cluster.router.url})
    assert _failed(report) == set()
    assert _status(report, "d2p_read") is Status.PASS and "P's reports" in report.get("d2p_read").detail  # type: ignore[union-attr]
    # A stock P sends no report: the router's remote_hit is inferred from cached_tokens, which P's own
    # cache also fills. With P's bidirectional off the router still counts remote_hit: say so.
    async with sim_cluster(p={"bidirectional_kv_xfer": False}) as cluster:
        stock = await _check({"router": cluster.router.url})
        with_p = await _check({"router": cluster.router.url, "prefill": cluster.p.url, "decode": cluster.d.url})
    assert _status(stock, "d2p_read") is Status.UNKNOWN and _failed(stock) == set()
    assert stock.exit_code() == EXIT_OK and stock.exit_code(strict=True) == EXIT_FAILED
    assert "bidirectional_prefill" in _failed(with_p)


async def test_passive_sends_no_traffic_and_still_checks_ttls() -> None:
    async with sim_cluster(router={"entry_ttl": 478.0}) as cluster:
        report = await _check(cluster.urls, passive=True)
        turns = cluster.router.app.telemetry.registry.get_sample_value("kvdiag_router_requests_total",
                                                                       {"endpoint": "chat", "code": "200"})
        p_prompts = cluster.p.engine.metrics.prompt_tokens._value.get()
    assert turns is None and p_prompts == 0  # no completion reached the router or P
    assert _failed(report) == {"router_ttl"}
    assert _status(report, "d2p_read") is Status.SKIPPED


async def test_a_component_that_does_not_answer_exits_3() -> None:
    async with sim_cluster() as cluster:
        dead = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback
        report = await _check({**cluster.urls, "decode": dead})
    assert report.exit_code() == EXIT_UNREACHABLE
    assert _status(report, "decode_reachable") is Status.FAIL
    assert "127.0.0.1:9" in report.get("decode_reachable").detail  # type: ignore[union-attr]


async def test_other_traffic_makes_router_verdicts_undecided() -> None:
    async with sim_cluster() as cluster:
        import asyncio

        import aiohttp

        stop = asyncio.Event()

        async def noise() -> None:
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
                    async with session.post(cluster.router.url + "/v1/chat/completions", json=body) as resp:
                        await resp.read()

        task = asyncio.create_task(noise())
        try:
            report = await _check({"router": cluster.router.url})
        finally:
            stop.set()
            await task
    assert _status(report, "router_state") is Status.UNKNOWN
    assert "other traffic" in report.get("router_state").detail  # type: ignore[union-attr]
