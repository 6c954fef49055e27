"""The connector's pure parts: Contract 4's outcome rule, the block-hash digest, the error guard."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvdiag.instrumentation.guard import Guard
from kvdiag.instrumentation.sink import FieldsEventSink, event_json
from kvdiag.schema.events import PrefillReport, TurnEvent, read_events
from kvdiag.schema.prefill_outcome import DECLINED_EXPIRED, PrefillView
from kvdiag.schema.prefix_digest import MAX_CHECKPOINTS, DigestError, check_prefix, first_mismatch, make_digest


def view(**kw: object) -> PrefillView:
    base: dict[str, object] = dict(engine_request_id="cmpl-a-0", prompt_tokens=170, block_size=32, has_handle=True,
                                   remote_offered_tokens=139, engine_id="P", remote_engine_id="D",
                                   remote_request_id="cmpl-d-0")
    base.update(kw)
    return PrefillView(**base)  # type: ignore[arg-type]


def outcome(v: PrefillView, *, bidirectional: bool = True, threshold: int = 64) -> str:
    return v.outcome(bidirectional=bidirectional, threshold=threshold)[0].value


def test_remote_hit_report_round_trips_through_the_schema() -> None:
    v = view()
    v.read_started(139)
    v.read_done(983_040, 4.2)
    report = v.report(bidirectional=True, threshold=64)
    assert report.outcome == "remote_hit" and report.computed_tokens == 31 and report.transfer_bytes == 983_040
    assert PrefillReport.from_dict(report.to_dict()) == report


@pytest.mark.parametrize(("kw", "expected"), [
    ({"has_handle": False}, "unknown"),
    ({"has_handle": False, "request_failed": True}, "request_failed"),
    ({"mismatch_block": 2}, "prefix_mismatch"),
    ({"local_hit_tokens": 128}, "local_hit"),              # 139 - 128 = 11 < one block
    ({"local_hit_tokens": 96}, "below_threshold"),          # 43: a block or more, below 64
    ({"failure_type": DECLINED_EXPIRED}, "expired_remote_read"),
    ({"failure_type": "handshake_failed"}, "transfer_failed"),
    ({"request_failed": True}, "request_failed"),
    ({}, "unknown"),                                       # a read started but never completed
])
def test_outcome_rule_in_contract_order(kw: dict[str, object], expected: str) -> None:
    assert outcome(view(**kw)) == expected


def test_feature_off_on_p_wins_over_everything_else() -> None:
    v = view(mismatch_block=0, failure_type="transfer_failed")
    assert outcome(v, bidirectional=False) == "feature_disabled_on_prefill"


def test_threshold_zero_never_skips() -> None:
    assert outcome(view(local_hit_tokens=96), threshold=0) == "unknown"


def test_failed_read_reports_no_read_tokens() -> None:
    v = view()
    v.read_started(139)
    v.read_failed("transfer_failed")
    report = v.report(bidirectional=True, threshold=64)
    assert (report.outcome, report.remote_read_tokens, report.computed_tokens) == ("transfer_failed", 0, 170)
    assert report.failure_type == "transfer_failed"


@pytest.mark.parametrize("kw", [
    {}, {"has_handle": False, "engine_id": None, "remote_engine_id": None, "remote_request_id": None},
    {"mismatch_block": 1}, {"local_hit_tokens": 96}, {"failure_type": DECLINED_EXPIRED, "request_failed": True},
])
@pytest.mark.parametrize("read", ["none", "done", "failed"])
def test_the_connectors_report_dict_is_the_reports_to_dict(kw: dict[str, object], read: str) -> None:
    v = view(**kw)
    if read != "none":
        v.read_started(139)
        if read == "done":
            v.read_done(983_040, 4.23456)
        else:
            v.read_failed("transfer_failed")
    as_dict = v.report_dict(bidirectional=True, threshold=64)
    assert as_dict == v.report(bidirectional=True, threshold=64).to_dict()
    assert PrefillReport.from_dict(as_dict).to_dict() == as_dict


def test_digest_of_a_prefix_reads_only_the_held_blocks() -> None:
    all_hashes = hashes(list(range(32 * 10)))
    assert make_digest(all_hashes, 32, 4) == make_digest(all_hashes[:4], 32)
    assert make_digest(all_hashes, 32, 99) == make_digest(all_hashes, 32)      # more than held: all of them
    assert make_digest(all_hashes, 32, 0)["h"] == []


def hashes(tokens: list[int], block: int = 32) -> list[bytes]:
    """Chained block hashes, as vLLM's hasher chains the parent hash into each block."""
    out, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % block, block):
        parent = hashlib.sha256(parent + repr(tokens[i:i + block]).encode()).digest()
        out.append(parent)
    return out


def test_digest_finds_the_first_diverging_block() -> None:
    history = list(range(139))
    digest = make_digest(hashes(history), 32)
    assert digest["blocks"] == 4 and digest["stride"] == 1
    assert first_mismatch(digest, hashes(history + [7] * 31), 32) == (None, 4)
    edited = list(history)
    edited[70] = -1
    assert first_mismatch(digest, hashes(edited + [7] * 31), 32) == (2, 2)


def test_digest_stays_bounded_for_long_sequences() -> None:
    tokens = list(range(32 * 1000))
    digest = make_digest(hashes(tokens), 32)
    assert len(digest["h"]) <= MAX_CHECKPOINTS and digest["stride"] == 4
    edited = list(tokens)
    edited[32 * 501] = -1                       # block 501 differs: the checkpoint at block 503 catches it
    mismatch, matched = first_mismatch(digest, hashes(edited), 32)
    assert mismatch == matched == 500


def held(tokens: list[int], block: int = 32) -> dict[str, object]:
    """D's digest of the sequence it holds, with the end checkpoint over the partial last block."""
    full = len(tokens) // block
    return make_digest(hashes(tokens), block, full, tokens[full * block:])


def check(digest: dict[str, object], prompt: list[int], remote: int) -> tuple[int, int, int | None, int, int]:
    c = check_prefix(digest, hashes(prompt), prompt, 32, remote)
    return c.offered_tokens, c.proven_tokens, c.mismatch_block, c.mismatch_tokens, c.unverified_tokens


HISTORY = list(range(139))      # D's sequence: 4 full blocks and 11 tokens


def test_exact_check_proves_a_clean_continuation_to_the_last_token() -> None:
    digest = held(HISTORY)
    assert digest["tail"] == {"n": 11, "h": digest["tail"]["h"]} and len(digest["h"]) == 4  # type: ignore[index]
    assert check(digest, HISTORY + [7] * 31, 139) == (139, 139, None, 0, 0)
    # the partial block differs (a re-rendered last reply token): the 11 tokens are not proven
    changed = HISTORY[:-1] + [-5] + [7] * 31
    assert check(digest, changed, 139) == (139, 128, 4, 11, 0)


def test_exact_check_stays_inside_a_trimmed_handle() -> None:
    # the prompt diverges in block 3 (a stripped reasoning trace); the router offers 3 blocks only
    prompt = HISTORY[:100] + [9] * 70
    assert check(held(HISTORY), prompt, 96) == (96, 96, None, 0, 0)
    # the untrimmed handle: the divergence is inside what it offers
    assert check(held(HISTORY), prompt, 139) == (139, 96, 3, 43, 0)


def test_exact_check_on_a_prompt_shorter_than_ds_sequence() -> None:
    # regenerate: the prompt is D's turn prompt, a prefix of its sequence; its partial block has no hash
    assert check(held(HISTORY), HISTORY[:100], 139) == (100, 96, None, 0, 4)
    assert check(held(HISTORY), HISTORY[:128], 139) == (128, 128, None, 0, 0)


def test_exact_check_finds_an_edited_history() -> None:
    edited = list(HISTORY)
    edited[70] = -1
    assert check(held(HISTORY), edited + [7] * 31, 139) == (139, 64, 2, 75, 0)
    assert check(held(HISTORY), [-1, *HISTORY[1:]], 139)[1:3] == (0, 0)


def test_the_end_checkpoint_proves_the_blocks_past_the_last_stride_checkpoint() -> None:
    tokens = list(range(32 * 1001 + 5))         # 1001 full blocks, stride 4: the last checkpoint is block 999
    digest = held(tokens)
    assert digest["stride"] == 4 and len(digest["h"]) == 250  # type: ignore[arg-type]
    assert check(digest, [*tokens, 1], len(tokens)) == (len(tokens), len(tokens), None, 0, 0)
    edited = list(tokens)
    edited[32 * 1000 + 3] = -1                  # block 1000: no stride checkpoint, the end checkpoint catches it
    assert check(digest, [*edited, 1], len(tokens))[1:3] == (32 * 1000, 1000)
    # without an end checkpoint (an older D) those blocks stay unproven, never read
    bare = make_digest(hashes(tokens), 32)
    assert check(bare, [*tokens, 1], len(tokens)) == (len(tokens), 32 * 1000, None, 0, 32 + 5)


@pytest.mark.parametrize("tail", [{"n": 32, "h": "00000000"}, {"n": -1, "h": "00000000"}, {"n": 3},
                                  {"n": True, "h": "00000000"}, [3, "00000000"]])
def test_a_malformed_end_checkpoint_is_rejected(tail: object) -> None:
    digest = {**make_digest(hashes(HISTORY), 32), "tail": tail}
    with pytest.raises(DigestError):
        check_prefix(digest, hashes(HISTORY), HISTORY, 32, 139)


def test_mismatch_tokens_travel_in_the_report_and_the_pull_limit_sets_the_remainder() -> None:
    v = view(mismatch_block=2, mismatch_tokens=75, pull_limit_tokens=64)
    assert v.remainder_tokens == 64
    v.read_started(64)
    v.read_done(2 * 196_608, 1.0)
    as_dict = v.report_dict(bidirectional=True, threshold=64)
    assert as_dict["mismatch_tokens"] == 75 and as_dict["outcome"] == "prefix_mismatch"
    assert PrefillReport.from_dict(as_dict).mismatch_tokens == 75
    assert "mismatch_tokens" not in view().report_dict(bidirectional=True, threshold=64)


@pytest.mark.parametrize("bad", [
    None, [], {"block_size": 32, "stride": 1, "blocks": 1, "h": ["zz"]},
    {"block_size": 32, "stride": 0, "blocks": 1, "h": ["00000000"]},
    {"block_size": 32, "stride": 1, "blocks": 3, "h": ["00000000"]},
    {"block_size": 16, "stride": 1, "blocks": 1, "h": ["00000000"]},
    {"block_size": True, "stride": 1, "blocks": 1, "h": ["00000000"]},
    {"block_size": 32, "stride": 1, "blocks": 999, "h": ["00000000"] * 999},
])
def test_a_malformed_client_digest_is_rejected(bad: object) -> None:
    with pytest.raises(DigestError):
        first_mismatch(bad, hashes(list(range(64))), 32)


def test_guard_swallows_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard("test")
    with caplog.at_level(logging.WARNING, logger="vllm.kvdiag"):
        for _ in range(3):
            with guard:
                raise KeyError("boom")
    assert guard.errors == 3 and guard.take_unreported() == 3 and guard.take_unreported() == 0
    assert len([r for r in caplog.records if "kvdiag instrumentation error in test" in r.getMessage()]) == 1
    with pytest.raises(KeyboardInterrupt), guard:
        raise KeyboardInterrupt


def test_instrumentation_package_and_the_outcome_rule_do_not_import_vllm() -> None:
    code = ("import sys, kvdiag.instrumentation, kvdiag.instrumentation.guard, kvdiag.schema.prefill_outcome, "
            "kvdiag.schema.prefix_digest; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'nixl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_sim_options_map_onto_the_real_engine_backend() -> None:
    from kvdiag.sim.vllm_backend.options import CPU_MAX_BLOCKS, options_from_sim, parse_args

    opts = options_from_sim("decode", {"port": 0, "no_bidirectional": True, "no_prefix_caching": True,
                                       "num_blocks": 16384, "decoder_kv_blocks_ttl": 30.0, "log_level": "debug",
                                       "events_file": "d.jsonl", "kv_recompute_threshold": 128})
    assert (opts.role, opts.bidirectional, opts.prefix_caching) == ("decode", False, False)
    assert (opts.num_blocks, opts.decoder_kv_blocks_ttl, opts.log_level) == (CPU_MAX_BLOCKS, 30.0, "DEBUG")
    assert (opts.events_file, opts.kv_recompute_threshold) == ("d.jsonl", 128)
    cli = parse_args(["prefill", "--no-prefix-caching", "--kv-recompute-threshold", "0"])
    assert (cli.role, cli.prefix_caching, cli.pull_matching_prefix, cli.kv_recompute_threshold) == \
        ("prefill", False, True, 0)   # exact mode is on by default
    assert parse_args(["prefill", "--no-pull-matching-prefix"]).pull_matching_prefix is False
    assert options_from_sim("prefill", {}).pull_matching_prefix is True
    off = options_from_sim("prefill", {"pull_matching_prefix": False, "prefix_digest": False})
    assert (off.pull_matching_prefix, off.prefix_digest) == (False, False)
    assert parse_args(["decode", "--no-prefix-digest"]).prefix_digest is False


@pytest.mark.parametrize("fields", [
    {"source": "decode", "event": "kv_released", "engine_request_id": "cmpl-d-0", "retained_blocks": 5,
     "ttl_s": 480.0, "release_reason": "expired", "attrs": {"held_s": 1.5, "unread": True, "notifications": 0}},
    {"source": "prefill", "event": "prefill_request", "prompt_tokens": 170, "outcome": "remote_hit", "attrs": {}},
    {"source": "prefill", "event": "engine_start", "attrs": {"nested": {"a": [1, 2]}, "none": None}},
])
def test_the_fast_event_line_is_the_schemas_line(fields: dict[str, object]) -> None:
    event = TurnEvent(ts=1795940244.758, **fields)  # type: ignore[arg-type]
    assert event_json(event) == event.to_json()


def test_fields_sink_builds_events_on_its_thread_and_counts_bad_ones(tmp_path: Path) -> None:
    errors: list[int] = []
    sink = FieldsEventSink(tmp_path / "ev.jsonl", on_error=lambda: errors.append(1))
    sink.emit_fields({"ts": 1.0, "source": "decode", "event": "kv_retained", "retained_blocks": 4})
    sink.emit_fields({"ts": 2.0, "source": "decode", "event": "kv_retained", "no_such_field": 1})
    sink.emit_call(lambda blocks: {"ts": 3.0, "source": "decode", "event": "kv_retained",
                                   "retained_blocks": blocks}, 6)
    sink.emit_call(lambda: 1 // 0)   # a broken builder: counted, the writer goes on
    sink.emit_fields({"ts": 4.0, "source": "decode", "event": "kv_retained", "retained_blocks": 8})
    sink.close()
    assert [e.retained_blocks for e in read_events(tmp_path / "ev.jsonl")] == [4, 6, 8]
    assert (sink.written, sink.errors, errors) == (3, 2, [1, 1])
