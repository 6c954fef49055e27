"""The oracle on real vLLM 0.33.0: partial reuse never changes the KV P computes with.

For each agent scenario (tests/vllm_harness/kv_equivalence.py runs them all in one subprocess:
real v1 Scheduler, real NixlConnector / KVDiagNixlConnector, real NIXL/UCX READs on CPU), turn
k+1's KV on P after the D->P read must be byte-identical, position by position, to what P computes
from scratch for the same prompt whenever P gets the handle kvdiag's router gives it (trimmed to
the proven prefix), or the full handle with the connector's exact mode. The full handle on a stock
P, or with exact mode off, is the negative control: it must be caught as wrong KV. Each read is
also checked for what it read: the D blocks vLLM paired with P's blocks, which D blocks the bytes
are, NIXL's bytes, and what P computed; and the turn must complete (D reads P's blocks, decodes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdiag.schema.events import PrefillReport, read_events

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).parent
BLOCK = 32
BLOCK_BYTES = 2 * 98_304          # one block, both layers of the OPT-shaped CPU model
SCENARIOS = ("reasoning_stripped", "tool_call_rerendered", "include_reasoning_false", "edited_history",
             "regenerate", "clean_continuation")
TRIMMED = SCENARIOS[:-1]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kv-equivalence")
    try:
        proc = subprocess.run([sys.executable, "-m", "vllm_harness.kv_equivalence", str(out)], cwd=TESTS,
                              timeout=300, capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired:
        log = (out / "engine.log").read_text(errors="replace")
        pytest.fail(f"the KV-equivalence process hung\nlog tail:\n{log[-8000:]}")
    results_file = out / "results.json"
    assert proc.returncode == 0 and results_file.exists(), (proc.stdout[-3000:], proc.stderr[-3000:],
                                                            (out / "engine.log").read_text(errors="replace")[-5000:])
    results: dict[str, Any] = json.loads(results_file.read_text())
    assert "error" not in results, results["error"]
    results["_out"] = str(out)
    return results


def variant(run: dict[str, Any], scenario: str, name: str) -> dict[str, Any]:
    found = [v for v in run["variants"] if v["scenario"] == scenario and v["variant"] == name]
    assert len(found) == 1, (scenario, name)
    rec: dict[str, Any] = found[0]
    # every turn completed: D generated the planned reply, P finished its prefill
    assert (rec["d_finish"], rec["d_generated_ok"], rec["p_finish"]) == ("length", True, "length"), rec
    return rec


def assert_read_exactly(rec: dict[str, Any], tokens: int, prompt_tokens: int, local: int = 0) -> None:
    """P holds D's first ceil(tokens/32) blocks at its positions 0..: the first ``local`` tokens from its
    own prefix cache, the rest read from D (vLLM pairs P's new blocks with the end of the handle's
    list), and computed the rest of the prompt."""
    blocks = _cdiv(tokens, BLOCK)
    assert rec["read_tokens"] == tokens > local, rec     # P's computed tokens when the read landed
    assert rec["read_d_blocks"] == list(range(blocks)), rec   # which of D's blocks P's blocks now equal
    assert rec["vllm_read_d_blocks"] == list(range(local // BLOCK, blocks)), rec
    assert rec["nixl_bytes"] == [(blocks - local // BLOCK) * BLOCK_BYTES], rec
    # ... and the turn completed: D's decode leg read P's blocks (byte-exact) and generated its reply
    assert (rec["next_d_finish"], rec["next_d_ok"], rec["next_d_read_matches_p"]) == ("length", True, True), rec
    assert rec["next_d_read_blocks"] == _cdiv(prompt_tokens, BLOCK)
    report = rec["report"]
    if report is not None:   # the kvdiag connector's own account of the same read
        r = PrefillReport.from_dict(report)
        assert (r.local_hit_tokens, r.remote_read_tokens, r.computed_tokens) == \
            (local, tokens - local, prompt_tokens - tokens)
        assert r.transfer_bytes == (blocks - local // BLOCK) * BLOCK_BYTES


def test_every_scenario_ran_every_injection(run: dict[str, Any]) -> None:
    got = {(v["scenario"], v["variant"]) for v in run["variants"]}
    expected = {(s, v) for s in TRIMMED for v in ("router_trim@stock", "router_trim@exact", "full@stock",
                                                  "full@exact", "full@exact_off")}
    expected |= {(s, v) for s in TRIMMED for v in ("router_trim@stock_pc", "full@exact_pc", "full@stock_pc")}
    expected |= {("tool_call_rerendered", "trim_no_margin@stock")}
    expected |= {("clean_continuation", v) for v in ("full@stock", "full@exact", "full@stock_pc", "full@exact_pc")}
    assert got == expected
    # the scenarios diverge where the template makes them: D's sequence is not a prefix of the next prompt
    for name in TRIMMED:
        s = run["scenarios"][name]
        assert s["common_prefix"] < s["d_tokens"], (name, s)
    clean = run["scenarios"]["clean_continuation"]
    assert clean["common_prefix"] == clean["d_tokens"] < clean["next_prompt_tokens"]


@pytest.mark.parametrize("scenario", TRIMMED)
@pytest.mark.parametrize("p", ["stock", "exact"])
def test_router_trimmed_handle_gives_byte_identical_kv(run: dict[str, Any], scenario: str, p: str) -> None:
    rec = variant(run, scenario, f"router_trim@{p}")
    s = run["scenarios"][scenario]
    t = (s["rung_tokens"] - run["margin"]) // BLOCK * BLOCK
    assert rec["router_t"] == rec["injected_tokens"] == t and rec["injected_blocks"] == t // BLOCK
    assert rec["wrong_positions"] == 0, rec
    assert_read_exactly(rec, t, s["next_prompt_tokens"])
    if p == "exact":   # the trimmed handle passes the block-hash check untouched
        r = PrefillReport.from_dict(rec["report"])
        assert (r.outcome, r.mismatch_tokens, r.remote_offered_tokens) == ("remote_hit", 0, t)


@pytest.mark.parametrize("p", ["stock", "exact"])
def test_clean_continuation_reuses_ds_whole_sequence_byte_identical(run: dict[str, Any], p: str) -> None:
    rec = variant(run, "clean_continuation", f"full@{p}")
    s = run["scenarios"]["clean_continuation"]
    assert rec["injected_tokens"] == rec["handle_tokens"] == s["d_tokens"]
    assert rec["wrong_positions"] == 0, rec
    # every token D holds, its partial last block included (the digest's end checkpoint proves it)
    assert_read_exactly(rec, s["d_tokens"], s["next_prompt_tokens"])
    if p == "exact":
        assert PrefillReport.from_dict(rec["report"]).outcome == "remote_hit"


@pytest.mark.parametrize("scenario", TRIMMED)
def test_full_handle_on_stock_vllm_is_caught_as_wrong_kv(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "full@stock")
    s = run["scenarios"][scenario]
    assert rec["wrong_in_read"] > 0, rec
    want = min(s["d_tokens"], s["next_prompt_tokens"])
    assert rec["read_tokens"] == want
    # P keeps the KV it read except for the last prompt token, which vLLM recomputes after a full hit
    kept = min(want, s["next_prompt_tokens"] - 1)
    if s["next_prompt_tokens"] < s["d_tokens"]:
        # vLLM pairs P's blocks with the END of D's block list: D's last blocks land at positions 0..
        last = rec["handle_blocks"]
        assert rec["vllm_read_d_blocks"] == rec["read_d_blocks"] == list(range(last - _cdiv(want, BLOCK), last))
        assert rec["first_wrong"] == 0 and rec["wrong_in_read"] == kept
    else:
        assert rec["read_d_blocks"] == list(range(rec["handle_blocks"]))
        assert rec["first_wrong"] == s["common_prefix"]
        # every position from the divergence through D's sequence is wrong, also those whose own token
        # id equals D's (the edited history's): the KV depends on the whole prefix
        assert rec["wrong_in_read"] == kept - s["common_prefix"]


def test_the_edited_history_control_catches_equal_tokens_after_a_different_prefix(run: dict[str, Any]) -> None:
    s = run["scenarios"]["edited_history"]
    assert s["same_token_after_divergence"] > 0
    rec = variant(run, "edited_history", "full@stock")
    assert rec["wrong_in_read"] == s["d_tokens"] - s["common_prefix"]


def _proven(s: dict[str, Any]) -> int:
    """The longest prefix block hashes can prove: whole blocks up to the divergence, or D's whole
    sequence when the next prompt contains it."""
    if s["common_prefix"] >= s["d_tokens"]:
        return int(s["d_tokens"])
    return int(s["common_prefix"]) // BLOCK * BLOCK


@pytest.mark.parametrize("scenario", TRIMMED)
def test_exact_mode_makes_the_full_handle_byte_identical(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "full@exact")
    s = run["scenarios"][scenario]
    proven = _proven(s)
    assert rec["injected_tokens"] == rec["handle_tokens"] and rec["wrong_positions"] == 0, rec
    assert rec["vllm_remote_num_tokens"] == proven     # what P's connector left vLLM to count
    assert_read_exactly(rec, proven, s["next_prompt_tokens"])
    r = PrefillReport.from_dict(rec["report"])
    offered = min(rec["handle_tokens"], s["next_prompt_tokens"])
    if s["common_prefix"] < offered:        # a divergence inside what D offered
        assert (r.outcome, r.mismatch_tokens) == ("prefix_mismatch", offered - proven)
    else:                                   # regenerate: nothing diverges, the prompt is just shorter
        assert (r.outcome, r.mismatch_tokens) == ("remote_hit", 0)
    # exact mode never reads less than the router's trim would have
    assert proven >= variant(run, scenario, "router_trim@exact")["read_tokens"]


@pytest.mark.parametrize("scenario", TRIMMED)
def test_exact_mode_off_is_caught_as_wrong_kv(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "full@exact_off")
    stock = variant(run, scenario, "full@stock")
    assert rec["wrong_in_read"] == stock["wrong_in_read"] > 0
    assert rec["read_d_blocks"] == stock["read_d_blocks"]
    r = PrefillReport.from_dict(rec["report"])
    if scenario == "regenerate":
        # the digest agrees with every block of the shorter prompt, yet vLLM's end-trim reads D's last
        # blocks: only exact mode's front alignment prevents it
        assert r.outcome == "remote_hit"
    else:
        assert r.outcome == "prefix_mismatch" and r.mismatch_tokens and r.mismatch_tokens > 0


def test_a_trim_without_the_generation_prompt_margin_is_caught(run: dict[str, Any]) -> None:
    s = run["scenarios"]["tool_call_rerendered"]
    rec = variant(run, "tool_call_rerendered", "trim_no_margin@stock")
    t = s["rung_tokens"] // BLOCK * BLOCK
    assert rec["injected_tokens"] == t > s["common_prefix"]
    assert rec["wrong_in_read"] == t - s["common_prefix"] == 2 and rec["first_wrong"] == s["common_prefix"]


def test_exact_mode_events_carry_the_mismatch(run: dict[str, Any]) -> None:
    evs = {e.engine_request_id: e for e in read_events(Path(run["_out"]) / "pexact-events.jsonl")
           if e.event == "prefill_request"}
    full = evs["cmpl-edited_history-full@exact-tk1-p-0"]
    assert (full.outcome, full.mismatch_tokens, full.remote_read_tokens) == ("prefix_mismatch", 73, 160)
    assert full.attrs["pulled_matching_prefix"] is True and full.attrs["proven_tokens"] == 160
    regen = evs["cmpl-regenerate-full@exact-tk1-p-0"]
    assert regen.attrs["unverified_tokens"] == 123 - 96 and regen.mismatch_tokens == 0
    trimmed = evs["cmpl-edited_history-router_trim@exact-tk1-p-0"]
    assert trimmed.mismatch_tokens == 0 and "pulled_matching_prefix" not in trimmed.attrs


# --- P with prefix caching (vLLM's default): its cache holds the system prompt, so vLLM reads D's
# blocks after P's local hit, pairing P's new blocks with the end of the handle's block list.

def _local(s: dict[str, Any]) -> int:
    return int(s["system_tokens"]) // BLOCK * BLOCK


@pytest.mark.parametrize("scenario", TRIMMED)
def test_router_trim_after_a_local_prefix_hit_is_byte_identical(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "router_trim@stock_pc")
    s = run["scenarios"][scenario]
    t = (s["rung_tokens"] - run["margin"]) // BLOCK * BLOCK
    assert rec["injected_tokens"] == t and rec["wrong_positions"] == 0, rec
    assert_read_exactly(rec, t, s["next_prompt_tokens"], local=_local(s))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_exact_mode_after_a_local_prefix_hit_is_byte_identical(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "full@exact_pc")
    s = run["scenarios"][scenario]
    assert rec["injected_tokens"] == rec["handle_tokens"] and rec["wrong_positions"] == 0, rec
    assert_read_exactly(rec, _proven(s), s["next_prompt_tokens"], local=_local(s))


def test_clean_continuation_after_a_local_prefix_hit_reads_the_rest_of_ds_sequence(run: dict[str, Any]) -> None:
    rec = variant(run, "clean_continuation", "full@stock_pc")
    s = run["scenarios"]["clean_continuation"]
    assert rec["wrong_positions"] == 0, rec
    assert_read_exactly(rec, s["d_tokens"], s["next_prompt_tokens"], local=_local(s))


@pytest.mark.parametrize("scenario", TRIMMED)
def test_full_handle_after_a_local_prefix_hit_is_caught_as_wrong_kv(run: dict[str, Any], scenario: str) -> None:
    rec = variant(run, scenario, "full@stock_pc")
    s = run["scenarios"][scenario]
    assert rec["wrong_in_read"] > 0, rec
    want = min(s["d_tokens"], s["next_prompt_tokens"])
    last, first = rec["handle_blocks"], _local(s) // BLOCK
    # vLLM reads the last ceil(want/32) - local blocks of D's list into P's blocks after its local hit
    assert rec["vllm_read_d_blocks"] == list(range(last - (_cdiv(want, BLOCK) - first), last))
    if s["next_prompt_tokens"] < s["d_tokens"]:
        assert rec["first_wrong"] == _local(s)       # misaligned from the first block read
    else:
        assert rec["first_wrong"] == s["common_prefix"]
