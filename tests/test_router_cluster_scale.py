"""The bounded version of benchmarks/router_scale_bench.py: replicas, a filled Redis Cluster, real traffic.

Two router processes share a real 3-master cluster holding 20,000 handles written in their layout;
600 conversations at once, 3 turns each, spread over the replicas. Every later turn finds its handle,
the routers' memory and metric series stay bounded, and the store stays within its bound.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # minutes of real servers: `make test-fast` leaves it out

ROOT = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("router_scale_bench", ROOT / "benchmarks" / "router_scale_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["router_scale_bench"] = module
    spec.loader.exec_module(module)
    return module


async def test_a_filled_cluster_behind_two_replicas_stays_bounded(tmp_path: Path) -> None:
    bench = _bench()
    args = argparse.Namespace(conversations=600, handles=20_000, capacity=20_480, replicas=2, turns=3, think=1.0,
                              json=None)
    results = await bench.run(args, tmp_path)
    warm, main = results["phases"]
    assert warm["errors"] == main["errors"] == 0
    assert main["turns"] == 600 * 3 and main["later_turns"] == 1200
    assert main["later_turns_reused"] == main["later_turns"]  # every later turn found its handle
    assert warm["later_turns_reused"] == warm["later_turns"]
    # The fill took the store to its bound; real traffic evicted the oldest, per bucket, and stayed within it.
    assert results["store_after_fill"] >= 20_000
    assert results["store_entries_end"] <= results["store_bound"] == 20_480
    assert results["evictions_capacity"] > 0 and results["store_errors"] == 0
    # Memory and series: 600 more conversations grow neither beyond a fixed budget.
    assert all(peak < 160_000 for peak in results["rss_peak_kib"]), results["rss_peak_kib"]
    assert all(end - start < 60_000 for start, end in zip(results["rss_start_kib"], results["rss_end_kib"],
                                                           strict=True))
    assert all(n < 400 for n in results["series_end"]), results["series_end"]
    assert results["fill"]["mean_handle_json_bytes"] > 1500
