"""The live check's pure rules: block sizes from block lists, clock bounds, TTL rules, metric deltas, msgpack."""

from __future__ import annotations

import math
import struct
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdiag.check.facts import (
    BlockSizeRange,
    block_size_range,
    clock_skews,
    handle_observation,
    ranges_agree,
    router_ttl_problem,
    suggest_entry_ttl,
)
from kvdiag.check.findings import Findings, Status
from kvdiag.check.scrape import Scrape, ScrapeError, delta, delta_by_label
from kvdiag.check.sidechannel import SideChannelError, decode_msgpack_float


@given(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]), st.lists(st.integers(1, 5000), min_size=1, max_size=4))
def test_block_size_range_always_contains_the_true_size(size: int, token_counts: list[int]) -> None:
    obs = [(n, math.ceil(n / size)) for n in token_counts]
    found = block_size_range(obs)
    assert found.lo <= size <= found.hi


def test_block_size_pinned_to_one_power_of_two_and_mismatch_detected() -> None:
    p = block_size_range([(368, 23), (513, 33)], slack_tokens=1)
    d = block_size_range([(448, 14)], slack_tokens=1)
    assert p.best() == 16 and d.best() == 32
    assert ranges_agree(p, d) is False
    assert ranges_agree(p, block_size_range([(463, 29)], slack_tokens=1)) is True
    # too few tokens to tell 16 from 32 apart: undecided, never a false alarm
    vague = block_size_range([(10, 1)])
    assert vague.best() is None and ranges_agree(vague, p) is None
    assert BlockSizeRange(5, 4).empty and ranges_agree(BlockSizeRange(5, 4), p) is None


def test_handle_observation_reads_only_well_formed_params() -> None:
    assert handle_observation({"remote_num_tokens": 40, "remote_block_ids": [[1, 2, 3]]}) == (40, 3)
    for bad in (None, {}, {"remote_num_tokens": True, "remote_block_ids": [[1]]},
                {"remote_num_tokens": 4, "remote_block_ids": []}, {"remote_num_tokens": 4, "remote_block_ids": [[]]}):
        assert handle_observation(bad) is None


def test_clock_bounds_from_date_headers() -> None:
    samples = [SimpleNamespace(component="router", local_before=1000.2, local_after=1000.3, remote=1030.0),
               SimpleNamespace(component="prefill", local_before=1000.2, local_after=1000.3, remote=1000.0)]
    skews = {s.component: s for s in clock_skews(samples)}
    assert skews["router"].beyond(2.0) and not skews["prefill"].beyond(2.0)
    assert skews["prefill"].low <= 0 <= skews["prefill"].high
    # a Date one second behind (truncation) is never called skewed
    late = clock_skews([SimpleNamespace(component="d", local_before=1000.9, local_after=1000.95, remote=1000.0)])
    assert not late[0].beyond(0.5)


def test_ttl_rules() -> None:
    assert router_ttl_problem(450, 480) is None
    assert "not below" in (router_ttl_problem(476, 480) or "")
    assert "P declines every D->P read" in (router_ttl_problem(2, 5) or "")
    assert suggest_entry_ttl(480) == 450 and router_ttl_problem(suggest_entry_ttl(60), 60) is None
    assert router_ttl_problem(suggest_entry_ttl(12), 12) is None


METRICS_BEFORE = """# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 1.0
# TYPE kvdiag_lookups counter
kvdiag_lookups_total{result="hit"} 3.0
kvdiag_lookups_total{result="miss"} 1.0
"""
METRICS_AFTER = METRICS_BEFORE.replace(" 1.0\n# TYPE kvdiag", " 3.0\n# TYPE kvdiag").replace(
    'result="hit"} 3.0', 'result="hit"} 4.0')


def test_scrape_deltas() -> None:
    before, after = Scrape.parse(METRICS_BEFORE), Scrape.parse(METRICS_AFTER)
    assert delta(before, after, "vllm:nixl_num_failed_transfers_total") == 2.0
    assert delta(before, after, "vllm:nixl_num_failed_transfers_total", model_name="other") == 0.0
    assert delta(before, after, "absent_total") is None
    assert delta_by_label(before, after, "kvdiag_lookups_total", "result") == {"hit": 1.0}
    with pytest.raises(ScrapeError):
        Scrape.parse("this is { not prometheus")


def test_msgpack_clock_frame() -> None:
    assert decode_msgpack_float(b"\xcb" + struct.pack(">d", 1234.5)) == 1234.5
    assert decode_msgpack_float(b"\xca" + struct.pack(">f", 2.5)) == 2.5
    with pytest.raises(SideChannelError):
        decode_msgpack_float(b"\xa3abc")


def test_findings_keep_the_worse_result_and_both_evidences() -> None:
    f = Findings()
    f.add("d2p_read", Status.PASS, "router says fine", evidence=["router: a"])
    f.add("d2p_read", Status.FAIL, "P says failed", "fix it", ["P: b"])
    f.add("d2p_read", Status.PASS, "again fine", evidence=["router: c"])
    got = f.ordered()[0]
    assert got.status is Status.FAIL and got.detail == "P says failed" and got.fix == "fix it"
    assert got.evidence == ["P: b", "router: a", "router: c"]
    f.skip("d2p_read", "never overrides a result")
    assert f.ordered()[0].status is Status.FAIL
    with pytest.raises(KeyError):
        f.add("no_such_check", Status.PASS, "x")
