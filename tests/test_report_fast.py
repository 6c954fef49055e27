"""The DuckDB fast path gives the same turn table as explain's parser + build_turn_table."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kvdiag.diagnostics.explain import load_turns
from kvdiag.diagnostics.report import ReportError, build_turn_table, load_turn_table, normalize_table
from kvdiag.diagnostics.report_fast import all_events, events_turn_table
from kvdiag.diagnostics.report_synth import SynthParams, client_events, router_events, synthetic_conversations

# The free-text reason may differ (the classifier appends failure context); every number,
# bucket, verdict and derived flag must not.
COMPARED = [c for c in normalize_table(build_turn_table([])).columns if c != "reason"]


def _convs() -> list:  # type: ignore[type-arg]
    convs = synthetic_conversations(SynthParams(conversations=60, seed=21, missing_metadata_share=0.1))
    convs[0].turns[1].status = "error"
    convs[2].turns[0].status = "timeout"
    return convs


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    key = ["conversation_id", "turn"]
    a = a.sort_values(key).reset_index(drop=True)[COMPARED]
    b = b.sort_values(key).reset_index(drop=True)[COMPARED]
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-9)


@pytest.mark.parametrize("layout", ["router", "router+client", "router+client+duplicate", "no-router-gaps"])
def test_fast_path_matches_the_parser(tmp_path: Path, layout: str) -> None:
    convs = _convs()
    router = list(router_events(convs))
    if layout == "no-router-gaps":  # the gap must then come from start and duration
        router = [json.dumps({k: v for k, v in json.loads(line).items() if k != "gap_s"}) for line in router]
    files = [_write(tmp_path / "router-events.jsonl", router)]
    if layout != "router" and layout != "no-router-gaps":
        client = list(client_events(convs))
        if layout.endswith("duplicate"):
            client.append(client[3])  # a repeated record forces the aggregate (merge) path
        files.append(_write(tmp_path / "client.jsonl", client))
    assert all_events(files)
    fast = normalize_table(events_turn_table(files))
    slow = build_turn_table(load_turns(files))
    assert len(fast) == sum(len(c.turns) for c in convs)
    _same(fast, slow)


def test_fast_path_skips_corrupt_lines_and_mixed_inputs_use_the_parser(tmp_path: Path) -> None:
    convs = _convs()
    lines = list(router_events(convs))
    lines.insert(5, '{"v": 1, "ts": "not a number", broken')
    files = [_write(tmp_path / "router-events.jsonl", lines)]
    assert len(events_turn_table(files)) == sum(len(c.turns) for c in convs)
    stock = _write(tmp_path / "decode.log", [
        "(EngineCore_DP0 pid=1) INFO 11-29 06:54:50 [base_scheduler.py:188] Bidirectional KV transfer is enabled "
        "and the kv recompute threshold is set to 64 tokens.KV blocks on D are released after a TTL of 480 seconds."])
    assert not all_events([*files, stock])
    events = load_turn_table([*files, stock], events_only=True)
    assert len(events) == sum(len(c.turns) for c in convs)
    with pytest.raises(ReportError, match="no kvdiag event files"):
        load_turn_table([stock], events_only=True)
