"""The demo's process handling: whole process groups stop, a failed start says why."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from kvdiag.demo.processes import Component, ComponentError, group_members
from kvdiag.demo.summary import EXPECTED_VERDICTS, summarize
from kvdiag.schema.events import TurnEvent
from kvdiag.schema.verdicts import Verdict


def test_stop_kills_the_whole_group_even_if_it_ignores_sigterm(tmp_path: Path) -> None:
    # A parent and a grandchild that both ignore SIGTERM: only the group SIGKILL ends them.
    script = "trap '' TERM; sleep 60 & sleep 60; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    comp = Component(name="stubborn", argv=["sh"], process=proc, console=tmp_path / "c.log",
                     ready_file=tmp_path / ".ready")
    deadline = time.monotonic() + 5
    while len(group_members(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(group_members(proc.pid)) >= 2
    started = time.monotonic()
    comp.stop(grace=0.3)
    assert group_members(proc.pid) == []
    assert proc.returncode is not None
    assert time.monotonic() - started < 3


def test_a_component_that_exits_early_reports_its_output(tmp_path: Path) -> None:
    with pytest.raises(ComponentError, match=r"(?s)exited with code 2 .*No such command"):
        Component.start("bogus", ["no-such-command"], tmp_path, ready_timeout=20)
    assert not (tmp_path / ".bogus.ready").exists()


def test_summary_counts_router_outcomes_and_skips_corrupt_lines(tmp_path: Path) -> None:
    router = tmp_path / "router-events.jsonl"
    client = tmp_path / "client.jsonl"
    turns = [("c1", 1, "first_turn", 30.0), ("c1", 2, "remote_hit", 10.0), ("c1", 3, "local_hit", 12.0),
             ("c2", 1, "first_turn", 50.0), ("c2", 2, "router_entry_expired", 40.0)]
    with router.open("w") as rf, client.open("w") as cf:
        for i, (conv, turn, outcome, ttft) in enumerate(turns):
            rf.write(TurnEvent(ts=1.0 + i, source="router", event="router_turn", conversation_id=conv, turn=turn,
                               request_id=f"r{i}", outcome=outcome).to_json() + "\n")
            cf.write(TurnEvent(ts=1.0 + i, source="client", event="client_turn", conversation_id=conv, turn=turn,
                               request_id=f"r{i}", ttft_ms=ttft, status="ok").to_json() + "\n")
        rf.write("{not json\n")
    summary = summarize(router, client)
    assert summary.router_turns == 5 and summary.skipped_lines == 1
    assert summary.outcomes["first_turn"] == 2 and summary.reused == 2 and summary.eligible == 3
    assert summary.ttft_p50_by_turn == {1: 40.0, 2: 25.0, 3: 12.0}
    assert summary.ttft_p50_by_outcome["remote_hit"] == 10.0
    assert Verdict.TRANSFER_FAILED in summary.missing and Verdict.REMOTE_HIT not in summary.missing
    assert Verdict.UNKNOWN not in EXPECTED_VERDICTS
