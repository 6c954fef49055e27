"""The metric catalog: naming rules, generated docs/metrics.md, and a golden /metrics exposition.

The golden file is the exposition of a fresh registry driven through a scripted turn sequence.
After an intended catalog change, refresh it with ``KVDIAG_UPDATE_GOLDEN=1 pytest tests/test_catalog.py``
and review the diff.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.schema import docs
from kvdiag.schema.metrics import CATALOG, MetricSpec, prompt_bucket, turn_bucket

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "router-exposition.txt"
GOLDEN_CONNECTOR = REPO / "tests" / "golden" / "connector-exposition.txt"
# Anything that could identify a conversation, a request or a user must never be a label.
_ID_LABEL = re.compile(r"(^|_)(id|ids|uuid|conversation|request|session|user|prompt_text)($|_)")


def test_docs_metrics_md_is_generated_from_the_catalog() -> None:
    committed = (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert committed == docs.render(), (
        "docs/metrics.md is stale: run `python -m kvdiag.schema.docs --out docs/metrics.md`")
    for spec in CATALOG:
        assert f"### `{spec.name}`" in committed


@pytest.mark.parametrize("spec", CATALOG, ids=lambda s: s.name)
def test_catalog_naming_rules(spec: MetricSpec) -> None:
    assert re.fullmatch(r"kvdiag_[a-z][a-z0-9_]*[a-z0-9]", spec.name), spec.name
    assert not spec.name.endswith("_total"), "counters are declared without _total (prometheus_client adds it)"
    if spec.unit:
        assert spec.name.endswith("_" + spec.unit), f"{spec.name}: the unit {spec.unit!r} belongs in the name"
    if spec.type == "histogram":
        assert spec.unit, f"{spec.name}: a histogram needs a unit"
        assert list(spec.buckets) == sorted(set(spec.buckets)) and spec.buckets, spec.name
    else:
        assert not spec.buckets, spec.name
    assert spec.help.strip().endswith("."), f"{spec.name}: help should be a sentence"
    for label in spec.labels:
        assert not _ID_LABEL.search(label), f"{spec.name}: label {label!r} looks like an id"
    assert {label for label, _ in spec.label_values} <= set(spec.labels), spec.name


def test_catalog_names_are_unique() -> None:
    names = [s.name for s in CATALOG]
    assert len(names) == len(set(names))


def test_bucketing_helpers_are_bounded() -> None:
    assert [turn_bucket(t) for t in (0, 1, 2, 3, 4, 7, 8, 500)] == ["1", "1", "2", "3", "4-7", "4-7", "8+", "8+"]
    assert [prompt_bucket(t) for t in (0, 2047, 2048, 8191, 16384, 32767, 10**6)] == [
        "<2k", "<2k", "2-8k", "2-8k", "16-32k", "16-32k", "32k+"]


def _scripted_exposition() -> str:
    """Drive a fresh registry through a fixed sequence of turns and return its /metrics text."""
    registry = CollectorRegistry()
    m = CatalogMetrics(registry, component="router")
    model = "qwen3-32b"
    script = [  # (turn, prompt tokens, outcome, reused, ttft)
        (1, 1500, "first_turn", "false", 0.158),
        (2, 3000, "remote_hit", "true", 0.122),
        (3, 9000, "expired_remote_read", "false", 0.778),
        (4, 20000, "remote_hit", "true", 0.460),
        (9, 40000, "not_a_verdict", "false", 2.334),  # unknown value -> "other", never a new series
    ]
    for turn, tokens, outcome, reused, ttft in script:
        m.labels("kvdiag_turns", model=model, outcome=outcome, turn_bucket=turn_bucket(turn),
                 prompt_bucket=prompt_bucket(tokens)).inc()
        m.labels("kvdiag_ttft_seconds", model=model, reused=reused).observe(ttft)
        m.labels("kvdiag_prefill_leg_seconds", model=model, reused=reused).observe(ttft * 0.9)
        m.labels("kvdiag_decode_leg_seconds", model=model).observe(1.5)
        m.labels("kvdiag_router_overhead_seconds", model=model).observe(0.0004)
        if turn > 1:
            m.labels("kvdiag_remote_reads", model=model).inc()
            m.labels("kvdiag_entry_age_seconds", model=model).observe(12.0 * turn)
            m.labels("kvdiag_inter_turn_gap_seconds", model=model).observe(10.0 * turn)
    m.labels("kvdiag_expired_remote_reads", model=model).inc()
    m.labels("kvdiag_transfer_bytes", model=model).observe(983040)
    m.labels("kvdiag_transfer_seconds", model=model).observe(0.03)
    m.labels("kvdiag_transfer_failures", model=model, failure_type="handshake_failed").inc()
    m.labels("kvdiag_missing_metadata", model=model, reason="not_streamed").inc()
    m.labels("kvdiag_prompt_tokens", model=model, source="remote_read").inc(2900)
    m.labels("kvdiag_prompt_tokens", model=model, source="computed").inc(1600)
    m.labels("kvdiag_lookups", result="hit").inc(2)
    m.labels("kvdiag_router_requests", endpoint="/v1/chat/completions", code="200").inc(5)
    m.labels("kvdiag_upstream_errors", leg="prefill", kind="timeout").inc()
    m.counter("kvdiag_concurrent_turns").inc()
    m.counter("kvdiag_client_disconnects").inc()
    m.labels("kvdiag_reuse_trimmed_tokens", model="Qwen/Qwen3-32B", reason="reasoning_stripped").inc(412)
    m.labels("kvdiag_reuse_trimmed_turns", model="Qwen/Qwen3-32B", reason="reasoning_stripped").inc()
    m.labels("kvdiag_reuse_offered_tokens", model="Qwen/Qwen3-32B").inc(1504)
    m.labels("kvdiag_reuse_decisions", model="Qwen/Qwen3-32B", reuse="trimmed").inc()
    m.gauge("kvdiag_in_flight_turns").set(0)
    m.gauge("kvdiag_store_entries").set(3)
    m.gauge("kvdiag_store_capacity").set(100000)
    m.labels("kvdiag_store_evictions", reason="ttl").inc()
    m.gauge("kvdiag_router_entry_ttl_seconds").set(450)
    m.gauge("kvdiag_decoder_kv_blocks_ttl_seconds").set(480)
    m.labels("kvdiag_emit_errors", component="router").inc(0)
    return _exposition(registry)


def _exposition(registry: CollectorRegistry) -> str:
    text = generate_latest(registry).decode()
    # ``*_created`` samples carry wall-clock timestamps; everything else is deterministic.
    return "".join(line + "\n" for line in text.splitlines() if not re.match(r"^\w+_created[ {]", line))


def _scripted_connector_exposition() -> str:
    """The connector's series as a P and a D engine would count one two-turn conversation."""
    registry = CollectorRegistry()
    m = CatalogMetrics(registry, component="connector")
    p = {"model_name": "Qwen/Qwen3-32B", "engine": "0"}
    m.labels("kvdiag_connector_requests", role="prefill", outcome="first_turn", **p).inc()
    m.labels("kvdiag_connector_requests", role="decode", outcome="unknown", **p).inc(2)
    m.labels("kvdiag_connector_retained_requests", **p).set(1)
    m.labels("kvdiag_connector_requests", role="prefill", outcome="remote_hit", **p).inc()
    m.labels("kvdiag_connector_remote_read_tokens", **p).inc(1504)
    m.labels("kvdiag_connector_released", reason="read", **p).inc()
    m.labels("kvdiag_connector_threshold_skips", **p).inc(0)
    m.labels("kvdiag_connector_mismatch_tokens", **p).inc(0)
    m.labels("kvdiag_emit_errors", component="connector").inc(0)
    return _exposition(registry)


@pytest.mark.parametrize(("golden", "render"), [(GOLDEN, _scripted_exposition),
                                                 (GOLDEN_CONNECTOR, _scripted_connector_exposition)],
                         ids=["router", "connector"])
def test_golden_exposition(golden: Path, render: Callable[[], str]) -> None:
    text = render()
    if os.environ.get("KVDIAG_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), "no golden file: run KVDIAG_UPDATE_GOLDEN=1 pytest tests/test_catalog.py"
    assert text == golden.read_text(encoding="utf-8"), (
        f"/metrics changed ({golden.name}); if intended, refresh with KVDIAG_UPDATE_GOLDEN=1 and review the diff")


def test_exposition_has_every_router_metric_and_no_stray_values() -> None:
    text = _scripted_exposition()
    for spec in CATALOG:
        if spec.component in ("router", "both"):
            assert re.search(rf"^# TYPE {spec.name}(_total)? {spec.type}$", text, re.MULTILINE), spec.name
        else:
            assert spec.name not in text
    assert 'outcome="other"' in text and "not_a_verdict" not in text
