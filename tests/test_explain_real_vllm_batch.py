"""vLLM 0.33 fails several requests in one line: ``Failing 2 request(s) due to KV load failure … Request IDs:
{'a', 'b'}``. Every request it names is joined to it, not only the first.

The fixture is lines real vLLM 0.33 wrote on the real-engine testbed (tests/test_explain_real_vllm.py's
run on a loaded machine: two back-to-back reads reached P within 5 s of D's 6 s TTL and were declined
in the same engine step), with the router's reference-proxy log of the same run.
"""

from __future__ import annotations

from pathlib import Path

from kvdiag.diagnostics.turn_loader import load_turns

FIXTURE = Path(__file__).parent / "fixtures" / "logs" / "real_vllm_batch_failure"


def test_a_batch_failure_line_reaches_every_request_it_names() -> None:
    assert "Failing 2 request(s) due to KV load failure" in (FIXTURE / "prefill.log").read_text()
    convs = {c.conversation_id: c for c in load_turns([str(FIXTURE)])}
    assert set(convs) == {"real-normal-a", "real-normal-b"}
    for conv in convs.values():
        turn = conv.turns[1]
        assert (turn.verdict.value, turn.confidence.value) == ("expired_remote_read", "confirmed"), turn.reason
        # the Failing line is the one that says how P failed the attempt; before, only the first id got it
        assert "failure_policy=fail" in turn.reason and "got its answer" in turn.reason, turn.reason
        assert any("Failing 2 request(s)" in ev.text for ev in turn.evidence), turn.evidence
