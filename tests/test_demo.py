"""The smoke test: the real demo end to end (sims, router, workload over sockets), once."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvdiag.cli.main import cli
from kvdiag.demo.run import OUTPUT_FILES
from kvdiag.demo.summary import EXPECTED_VERDICTS
from kvdiag.schema.events import read_events

_VLLM_LINE = re.compile(r"^\((EngineCore_DP0|APIServer) pid=\d+\) (DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (every demo component has the out dir in its argv)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_demo_produces_every_verdict_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = CliRunner().invoke(cli, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Turn outcomes" in result.output and "TTFT p50 ms by turn index" in result.output
    assert _processes_mentioning(str(out)) == []

    for name in OUTPUT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    events = {name: list(read_events(out / name)) for name in OUTPUT_FILES if name.endswith(".jsonl")}
    outcomes = {e.outcome for e in events["router-events.jsonl"] if e.event == "router_turn"}
    assert {v.value for v in EXPECTED_VERDICTS} <= outcomes
    assert {e.source for e in events["prefill-events.jsonl"]} == {"prefill"}
    assert {e.source for e in events["decode-events.jsonl"]} == {"decode"}
    client = events["client.jsonl"]
    assert client and all(e.source == "client" for e in client)
    stats = json.loads((out / "client-stats.json").read_text())
    assert len(stats) == len(client)
    # the client's request ids are the router's: the logs correlate
    router_ids = {e.request_id for e in events["router-events.jsonl"]}
    assert sum(e.request_id in router_ids for e in client) >= len(client) - 1
    for log in ("prefill.log", "decode.log"):  # stock vLLM lines, every one with the process prefix
        lines = (out / log).read_text().splitlines()
        assert lines and all(_VLLM_LINE.match(line) for line in lines), log
    assert "cache HIT" in (out / "proxy.log").read_text()
    elapsed = float(result.output.split("Done in ")[1].split(" s")[0])
    assert elapsed < 60
