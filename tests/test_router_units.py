"""Router building blocks without sockets: SSE capture, security helpers, config, lookup verdicts."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdiag.router.config import RouterConfig, RouterConfigError, Upstream
from kvdiag.router.reuse_rule import Decision, Reuse
from kvdiag.router.security import ANONYMOUS_TENANT, earlier_turns, hash_conversation_id, store_key, tenant_of
from kvdiag.router.sse import SSECapture
from kvdiag.router.store import Claim, Handle, LastTurn
from kvdiag.router.telemetry import RouterTelemetry
from kvdiag.router.turns import decide_lookup, prefill_verdict
from kvdiag.schema.events import PrefillReport
from kvdiag.schema.verdicts import TrimReason, Verdict

PARAMS = {"remote_block_ids": [[1, 2]], "remote_engine_id": "d", "remote_num_tokens": 33,
          "remote_blocks_expiry_time": 99.5}


HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _stream(params: object = PARAMS, key: bool = True, tokens: int = 1) -> bytes:
    # vLLM 0.33's layout: every token frame names kv_transfer_params (null) and finish_reason (null).
    def token(text: str) -> dict[str, object]:
        frame: dict[str, object] = {**HEAD, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                                         "finish_reason": None, "token_ids": None}]}
        if key:
            frame["kv_transfer_params"] = None
        return frame
    frames = [{**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}]
    frames += [token('he said "error" twice') for _ in range(tokens)]
    final: dict[str, object] = {**HEAD, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                                     "finish_reason": "length", "stop_reason": None}]}
    if key:
        final["kv_transfer_params"] = params
    frames.append(final)
    return b"".join(b"data: " + json.dumps(f, separators=(",", ":")).encode() + b"\n\n" for f in frames) \
        + b"data: [DONE]\n\n"


@given(st.lists(st.integers(min_value=1, max_value=400), min_size=1, max_size=30))
def test_capture_finds_params_however_the_stream_is_split(cuts: list[int]) -> None:
    data = _stream()
    capture = SSECapture()
    pos = 0
    for size in cuts:
        capture.feed(data[pos:pos + size])
        pos += size
    capture.feed(data[pos:])
    capture.close()
    assert capture.params == PARAMS and capture.done and capture.finish_reason == "length"
    assert capture.error is None and capture.malformed is None
    assert capture.observed is not None and capture.observed.content == 'he said "error" twice'


def test_capture_parses_token_frames_without_json() -> None:
    capture = SSECapture()
    capture.feed(_stream(tokens=200))
    assert capture.observed is not None and capture.observed.content == 'he said "error" twice' * 200
    assert capture.frames_parsed == 1  # only the final frame (params, finish): no token frame is json.loads-ed


def test_capture_tells_missing_key_from_null_params() -> None:
    absent, null = SSECapture(), SSECapture()
    absent.feed(_stream(key=False))
    null.feed(_stream(params=None))
    assert absent.params is None and not absent.params_present and absent.done
    assert null.params is None and null.params_present


def test_capture_records_error_events_and_malformed_frames() -> None:
    err = SSECapture()
    err.feed(b'data: {"error": {"message": "x", "code": 500}}\n\ndata: [DONE]\n\n')
    assert err.error == {"message": "x", "code": 500}
    bad = SSECapture()
    bad.feed(b'data: {"kv_transfer_params": {oops\n\n')
    bad.close()
    assert bad.malformed is not None and bad.params is None


def test_capture_handles_crlf_and_a_final_frame_without_blank_line() -> None:
    capture = SSECapture()
    capture.feed(b'data: {"kv_transfer_params": {"a": 1}}\r\n\r\ndata: [DONE]')
    capture.close()
    assert capture.params == {"a": 1} and capture.done


def test_capture_bounds_an_endless_frame() -> None:
    capture = SSECapture(max_frame_bytes=1000)
    for _ in range(10):
        capture.feed(b"x" * 500)
    assert capture.malformed is not None and "exceeded" in capture.malformed
    capture.feed(b'\n\ndata: {"kv_transfer_params": {"a": 1}}\n\n')
    assert capture.params is None  # scanning stopped: nothing from a broken stream is trusted


def test_capture_keeps_the_end_of_an_oversized_reply_and_marks_it_unreadable() -> None:
    data = _stream(tokens=3000)
    capture = SSECapture(max_frame_bytes=1 << 16, max_record_bytes=1 << 17)
    for i in range(0, len(data), 4096):
        capture.feed(data[i:i + 4096])
    assert capture.done and capture.params == PARAMS  # the final frame survives the bound
    assert capture.observed is not None and capture.observed.unreadable  # the reply itself is unverifiable


def test_tenant_hash_depends_on_the_token_only() -> None:
    assert tenant_of(None) == ANONYMOUS_TENANT == tenant_of("Bearer ")
    assert tenant_of("Bearer abc") == tenant_of("bearer   abc") != tenant_of("Bearer abd")
    assert "abc" not in tenant_of("Bearer abc")


def test_store_key_separates_tenants_and_hides_ids() -> None:
    assert store_key("t-1", "conv") != store_key("t-2", "conv")
    assert store_key("t-1", "a\x00b") != store_key("t-1\x00a", "b")
    assert "conv" not in store_key("t-1", "conv") and len(store_key("t", "x" * 5000)) == 32


def test_hashed_ids_are_stable_sha256_prefixes() -> None:
    import hashlib

    assert hash_conversation_id("CONV_ID_7") == hashlib.sha256(b"CONV_ID_7").hexdigest()[:16]


def _msgs(*contents: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]


def test_earlier_turns_counts_assistant_messages() -> None:
    assert earlier_turns({"messages": _msgs("a", "b", "c", "d", "e")}) == 2
    assert earlier_turns({"prompt": "x"}) == 0


def test_config_refuses_router_ttl_at_or_above_decoder_ttl() -> None:
    ups = (Upstream("127.0.0.1", 8100),)
    with pytest.raises(RouterConfigError, match=r"must be below decoder_kv_blocks_ttl \(480s\).*released blocks"):
        RouterConfig(prefill=ups, decode=ups, entry_ttl=480).validate()
    cfg = RouterConfig(prefill=ups, decode=ups).validate()
    assert cfg.handle_ttl == 450
    assert RouterConfig(prefill=ups, decode=ups, decoder_kv_blocks_ttl=10).handle_ttl == 5
    with pytest.raises(RouterConfigError, match="--state"):
        RouterConfig(prefill=ups, decode=ups, state="mysql://x").validate()
    with pytest.raises(RouterConfigError, match="prefiller"):
        RouterConfig(prefill=(), decode=ups).validate()


def test_model_label_is_bounded_so_clients_cannot_mint_series() -> None:
    # `model` comes from the client's body: a conversation or request id sent there must not become a series.
    ups = (Upstream("127.0.0.1", 8100),)
    telemetry = RouterTelemetry(RouterConfig(prefill=ups, decode=ups, max_model_labels=2))
    assert [telemetry.model_label(m) for m in ("a", "b", "a", "conv-123", "b")] == ["a", "b", "a", "other", "b"]
    assert telemetry.model_label(None) == telemetry.model_label("") == "unknown"
    roomy = RouterTelemetry(RouterConfig(prefill=ups, decode=ups))
    assert roomy.model_label("x" * 129) == "other" and roomy.model_label("Qwen/Qwen3-32B") == "Qwen/Qwen3-32B"


# ---------------------------------------------------------------------------------------- lookup verdicts
NOW = 1_000_000.0


def _claim(handle: Handle | None = None, last: LastTurn | None = None, acquired: bool = True) -> Claim:
    return Claim("tok" if acquired else None, handle, last)


FULL = Decision(Reuse.FULL, 41)
NONE = Decision(Reuse.NONE, 0, TrimReason.HISTORY_EDITED, "edited")


def _lookup(claim: Claim | None, earlier: int = 0, has_id: bool = True, decision: Decision = FULL) -> Verdict | None:
    return decide_lookup(has_id=has_id, claim=claim, decision=decision if claim and claim.handle else None,
                         earlier_turns=earlier, now=NOW, entry_ttl=450).verdict


def test_lookup_decides_every_router_verdict() -> None:
    handle = Handle({"remote_engine_id": "d"}, NOW - 10, 1, "r")
    assert _lookup(_claim(handle)) is None  # a hit: P decides
    assert _lookup(_claim(handle), decision=Decision(Reuse.TRIMMED, 32, TrimReason.REPLY_EDITED)) is None
    assert _lookup(_claim(handle), decision=NONE) is Verdict.PREFIX_MISMATCH
    not_kept = LastTurn(1, NOW - 5, False, "r", not_kept="unsupported request shape")
    assert _lookup(_claim(last=not_kept)) is Verdict.PREFIX_MISMATCH
    assert _lookup(_claim()) is Verdict.FIRST_TURN
    assert _lookup(None, has_id=False) is Verdict.FIRST_TURN
    assert _lookup(None, earlier=2, has_id=False) is Verdict.NO_CONVERSATION_ID
    assert _lookup(_claim(acquired=False)) is Verdict.CONCURRENT_TURN
    assert _lookup(_claim(last=LastTurn(1, NOW - 500, True, "r"))) is Verdict.ROUTER_ENTRY_EXPIRED
    assert _lookup(_claim(last=LastTurn(1, NOW - 5, True, "r"))) is Verdict.ROUTER_STATE_LOST
    assert _lookup(_claim(last=LastTurn(1, NOW - 5, False, "r", "not_streamed"))) is Verdict.METADATA_NOT_RETURNED
    assert _lookup(_claim(), earlier=3) is Verdict.ROUTER_STATE_LOST
    assert _lookup(None, earlier=1) is Verdict.ROUTER_STATE_LOST  # store unavailable


def test_lookup_numbers_turns_from_the_record() -> None:
    lk = decide_lookup(has_id=True, claim=_claim(last=LastTurn(4, NOW - 5, False, "r", "aborted")), decision=None,
                       earlier_turns=1, now=NOW, entry_ttl=450)
    assert lk.turn == 5 and lk.gap_s == 5 and "aborted" in (lk.reason or "")


def test_prefill_verdict_from_report_or_inferred() -> None:
    report = PrefillReport("id", 100, 0, 96, 80, 20, "remote_hit", transfer_bytes=10)
    assert prefill_verdict(report=report, cached_tokens=None, failed=False, entry_age_s=1,
                           decoder_ttl=480)[0] is Verdict.REMOTE_HIT
    assert prefill_verdict(report=None, cached_tokens=64, failed=False, entry_age_s=1,
                           decoder_ttl=480)[0] is Verdict.REMOTE_HIT
    assert prefill_verdict(report=None, cached_tokens=0, failed=False, entry_age_s=1,
                           decoder_ttl=480)[0] is Verdict.UNKNOWN
    assert prefill_verdict(report=None, cached_tokens=None, failed=True, entry_age_s=476,
                           decoder_ttl=480)[0] is Verdict.EXPIRED_REMOTE_READ
    assert prefill_verdict(report=None, cached_tokens=None, failed=True, entry_age_s=10,
                           decoder_ttl=480)[0] is Verdict.TRANSFER_FAILED


def test_capture_reads_vllm_tool_call_and_empty_deltas_without_json() -> None:
    # vLLM 0.33's hermes parser sets content to null beside tool calls; a finish chunk may carry {}.
    def frame(delta: dict[str, object], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": None}
        return b"data: " + json.dumps({**HEAD, "choices": [choice], "kv_transfer_params": None},
                                      separators=(",", ":")).encode() + b"\n\n"
    data = (frame({"role": "assistant", "content": ""}) + frame({"reasoning": "hmm"}) + frame({"content": "\n\n"})
            + frame({"content": None, "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                                                       "function": {"name": "lookup"}}]})
            + b"".join(frame({"content": None, "tool_calls": [{"index": 0, "function": {"arguments": a}}]})
                       for a in ('{"q"', ': "x"}'))
            + frame({}, "tool_calls") + b"data: [DONE]\n\n")
    capture = SSECapture()
    capture.feed(data)
    observed = capture.observed
    assert observed is not None and observed.content == "\n\n" and capture.finish_reason == "tool_calls"
    assert observed.parts == {"reasoning", "tool_calls"} and capture.frames_parsed == 1
