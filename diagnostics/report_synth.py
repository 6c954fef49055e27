"""Synthetic ConversationRecords with known parameters, for report/advise/HTML tests and benchmarks.

The generator follows Contract 4's rules: a gap at or past the router TTL is router_entry_expired,
one within vLLM's 5 s margin of the decode TTL is expired_remote_read, the rest read D's KV back
with transfer time = overhead + bytes / bandwidth and prefill time = base + ms/token × computed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvdiag.diagnostics.records import ConversationRecord, Evidence, TurnRecord
from kvdiag.schema.events import TurnEvent
from kvdiag.schema.verdicts import VERDICT_INFO, Confidence, Verdict


@dataclass(frozen=True)
class SynthParams:
    """Known ground truth for a synthetic run."""

    conversations: int = 200
    min_turns: int = 2
    max_turns: int = 9
    decoder_ttl_s: float = 480.0
    router_ttl_s: float | None = 450.0
    share_over_ttl: float = 0.2
    transfer_overhead_ms: float = 3.0
    bandwidth_gbps: float = 6.0  # GB/s (1e9 bytes/s), the sim time model's unit
    bytes_per_token: int = 131072
    prefill_base_ms: float = 8.0
    prefill_ms_per_token: float = 0.05
    attention_ms: float = 0.0  # sim time model: + n·(n/2)·attention for a prefill from scratch
    block_size: int = 16
    missing_metadata_share: float = 0.0
    trim_share: float = 0.0  # reused turns whose handle the router cut to the previous prompt
    trim_reasons: tuple[str, ...] = ("reasoning_stripped", "tool_call_rerendered", "history_reasoning")
    noise: float = 0.02
    seed: int = 7
    start_ts: float = 1_790_000_000.0


def _jitter(rng: random.Random, value: float, noise: float) -> float:
    return value * (1.0 + rng.uniform(-noise, noise))


def synthetic_conversations(p: SynthParams = SynthParams()) -> list[ConversationRecord]:
    """Return ``p.conversations`` conversations whose gaps, transfers and prefills follow ``p``."""
    rng = random.Random(p.seed)
    out: list[ConversationRecord] = []
    for c in range(p.conversations):
        conv = ConversationRecord(conversation_id=f"conv-{c:05d}")
        now = p.start_ts + rng.uniform(0, 3600)
        prompt = rng.randint(300, 24000)
        prev_total: int | None = None
        prev_prompt: int | None = None
        for turn in range(1, rng.randint(p.min_turns, p.max_turns) + 1):
            gap: float | None = None
            if turn > 1:
                if rng.random() < p.share_over_ttl:
                    gap = rng.uniform(p.decoder_ttl_s, 3 * p.decoder_ttl_s)
                else:
                    gap = rng.uniform(0.5, 0.6 * p.decoder_ttl_s)
                now += gap
            verdict, remote = Verdict.FIRST_TURN, 0
            reason = ""
            trim: dict[str, int | str | None] = {}
            if turn > 1 and prev_total is not None:
                if p.router_ttl_s is not None and gap is not None and gap >= p.router_ttl_s:
                    verdict = Verdict.ROUTER_ENTRY_EXPIRED
                elif gap is not None and gap >= p.decoder_ttl_s - 5.0:
                    verdict = Verdict.EXPIRED_REMOTE_READ
                elif rng.random() < p.missing_metadata_share:
                    verdict, reason = Verdict.METADATA_NOT_RETURNED, "previous decode response: not_streamed"
                else:
                    verdict, remote = Verdict.REMOTE_HIT, min(prev_total, prompt)
                    trim = {"handle_tokens": prev_total, "reuse_limit_tokens": prev_total, "wrong_kv_tokens": 0}
                    if p.trim_share and rng.random() < p.trim_share and prev_prompt is not None:
                        # the router proves the previous prompt only: whole blocks of it
                        limit = prev_prompt // p.block_size * p.block_size
                        trim.update(reuse_limit_tokens=limit, trimmed_tokens=prev_total - limit,
                                    trim_reason=rng.choice(p.trim_reasons), mismatch_tokens=0)
                        remote = min(limit, prompt)
            computed = prompt - remote
            xfer_bytes = xfer_ms = None
            if remote:
                blocks = -(-remote // p.block_size)
                xfer_bytes = blocks * p.block_size * p.bytes_per_token
                ideal = p.transfer_overhead_ms + xfer_bytes / (p.bandwidth_gbps * 1e6)
                xfer_ms = _jitter(rng, ideal, p.noise)
            compute = p.prefill_base_ms + p.prefill_ms_per_token * computed + p.attention_ms * computed * (
                prompt - computed + computed / 2)
            prefill = _jitter(rng, compute, p.noise) + (xfer_ms or 0)
            ttft = prefill + rng.uniform(8, 20)
            completion = rng.randint(50, 900)
            latency = ttft + completion * rng.uniform(8, 15)
            rec = TurnRecord(
                conversation_id=conv.conversation_id, turn=turn, request_id=f"req-{c}-{turn}",
                start_ts=now, end_ts=now + latency / 1000, ttft_ms=ttft, latency_ms=latency,
                prompt_tokens=prompt, completion_tokens=completion, local_hit_tokens=0,
                remote_offered_tokens=prev_total if turn > 1 else None, remote_tokens=remote or None,
                computed_tokens=computed, transfer_bytes=xfer_bytes, transfer_ms=xfer_ms, prefill_ms=prefill,
                gap_s=gap, status="ok", model="synthetic", verdict=verdict, confidence=Confidence.CONFIRMED,
                reason=reason or VERDICT_INFO[verdict].summary, fix=VERDICT_INFO[verdict].fix,
                evidence=[Evidence(source=f"router-events.jsonl:{c * 10 + turn}", text=f"outcome={verdict.value}")],
                **trim,  # type: ignore[arg-type]
            )
            conv.turns.append(rec)
            now = rec.end_ts or now
            prev_total = prompt + completion - 1
            prev_prompt = prompt
            prompt = prompt + completion + rng.randint(20, 2500)
        out.append(conv)
    return out


def router_events(conversations: Iterable[ConversationRecord], router_ttl_s: float | None = 450.0) -> Iterator[str]:
    """The router_turn event lines (schema v1) a kvdiag router would have written for these turns."""
    for conv in conversations:
        for t in conv.turns:
            yield TurnEvent(
                ts=round(t.start_ts or 0.0, 3), source="router", event="router_turn",
                conversation_id=conv.conversation_id, turn=t.turn, request_id=t.request_id, model=t.model,
                prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
                local_hit_tokens=t.local_hit_tokens, remote_offered_tokens=t.remote_offered_tokens,
                remote_read_tokens=t.remote_tokens, computed_tokens=t.computed_tokens,
                transfer_bytes=t.transfer_bytes, transfer_ms=_r3(t.transfer_ms), ttft_ms=_r3(t.ttft_ms),
                duration_ms=_r3(t.latency_ms), prefill_ms=_r3(t.prefill_ms), gap_s=_r3(t.gap_s),
                ttl_s=router_ttl_s, outcome=t.verdict.value, reason=t.reason, status=t.status,
                handle_tokens=t.handle_tokens, reuse_limit_tokens=t.reuse_limit_tokens,
                trimmed_tokens=t.trimmed_tokens, trim_reason=t.trim_reason, wrong_kv_tokens=t.wrong_kv_tokens,
                mismatch_tokens=t.mismatch_tokens,
            ).to_json()


def _r3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def write_router_events(conversations: Iterable[ConversationRecord], path: Path,
                        router_ttl_s: float | None = 450.0) -> Path:
    """Write :func:`router_events` to ``path`` (one JSON line per turn)."""
    with path.open("w", encoding="utf-8") as fh:
        for line in router_events(conversations, router_ttl_s):
            fh.write(line + "\n")
    return path


def client_events(conversations: Iterable[ConversationRecord]) -> Iterator[str]:
    """The client_turn event lines the kvdiag workload client would have written for these turns."""
    for conv in conversations:
        for t in conv.turns:
            yield TurnEvent(
                ts=round(t.start_ts or 0.0, 3), source="client", event="client_turn",
                conversation_id=conv.conversation_id, turn=t.turn, request_id=t.request_id, model=t.model,
                prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens, ttft_ms=_r3(t.ttft_ms),
                duration_ms=_r3(t.latency_ms), status=t.status,
            ).to_json()
