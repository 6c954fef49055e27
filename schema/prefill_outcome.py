"""P's outcome rule (docs/design.md, Contract 4): what P knows about one request, and its verdict.

Pure Python with no vLLM import, so the emulated engines and the real connector inside vLLM share
one rule and one report shape.

Usage::

    view = PrefillView(engine_request_id="cmpl-1-0", prompt_tokens=170, block_size=32,
                       has_handle=True, remote_offered_tokens=139, local_hit_tokens=0)
    view.read_started(tokens=139)
    view.read_done(transfer_bytes=983040, transfer_ms=4.2)
    report = view.report(bidirectional=True, threshold=64)   # PrefillReport, outcome remote_hit
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.schema.events import SCHEMA_VERSION, PrefillReport
from kvdiag.schema.verdicts import Verdict

# Failure type the worker records when NIXL declines a D->P read because D's deadline is within
# vLLM's 5 s safety margin ("Declining expired remote read ..."): the read never started.
DECLINED_EXPIRED: Final = "expired_declined"
NO_HANDLE_REASON: Final = "no D handle offered"


@dataclass
class PrefillView:
    """Facts the P side gathers for one request, from arrival to finish."""

    engine_request_id: str
    prompt_tokens: int
    block_size: int
    has_handle: bool = False
    engine_id: str | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_offered_tokens: int = 0
    local_hit_tokens: int = 0
    remote_read_tokens: int = 0
    pull_started: bool = False
    threshold_skipped: bool = False
    read_ok: bool = False
    failure_type: str | None = None
    transfer_bytes: int = 0
    transfer_ms: float = 0.0
    mismatch_block: int | None = None
    request_failed: bool = False
    failed_reason: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    # P's block-hash check: tokens D offered that did not match the prompt (None: no check ran)
    mismatch_tokens: int | None = None
    # remote_num_tokens P let vLLM count after its check (None: the handle's own)
    pull_limit_tokens: int | None = None

    def read_started(self, tokens: int) -> None:
        """P posted (or is about to post) the D->P read of ``tokens`` tokens."""
        self.pull_started = True
        self.remote_read_tokens = tokens

    def read_done(self, transfer_bytes: int, transfer_ms: float) -> None:
        """The D->P read completed with NIXL's bytes and transfer duration."""
        self.read_ok = True
        self.transfer_bytes += transfer_bytes
        self.transfer_ms += transfer_ms

    def read_failed(self, failure_type: str) -> None:
        """The D->P read failed (``DECLINED_EXPIRED`` when declined as expiring)."""
        self.read_ok = False
        self.failure_type = failure_type

    @property
    def remainder_tokens(self) -> int:
        """vLLM's D->P count: ``min(remote_num_tokens, prompt_tokens) - local_hit_tokens``."""
        remote = self.remote_offered_tokens if self.pull_limit_tokens is None else \
            min(self.remote_offered_tokens, self.pull_limit_tokens)
        return min(remote, self.prompt_tokens) - self.local_hit_tokens

    def outcome(self, *, bidirectional: bool, threshold: int) -> tuple[Verdict, str | None]:
        """Contract 4, in order; returns the verdict and a short reason."""
        failed_note = "; the request failed" if self.request_failed else ""
        if not self.has_handle:
            if self.request_failed:
                return Verdict.REQUEST_FAILED, self.failed_reason or "request failed"
            return Verdict.UNKNOWN, NO_HANDLE_REASON
        if not bidirectional:
            return Verdict.FEATURE_DISABLED_ON_PREFILL, "bidirectional_kv_xfer is off on P"
        if self.mismatch_block is not None:
            return Verdict.PREFIX_MISMATCH, f"prompt diverges from D's sequence at block {self.mismatch_block}"
        remainder = self.remainder_tokens
        if remainder < self.block_size:
            return Verdict.LOCAL_HIT, f"{remainder} remote tokens left after {self.local_hit_tokens} local hits"
        if threshold > 0 and remainder < threshold:
            return Verdict.BELOW_THRESHOLD, f"{remainder} remote tokens < threshold {threshold}"
        if self.failure_type == DECLINED_EXPIRED:
            return Verdict.EXPIRED_REMOTE_READ, "declined expired remote read" + failed_note
        if self.failure_type is not None:
            return Verdict.TRANSFER_FAILED, f"NIXL transfer failure: {self.failure_type}" + failed_note
        if self.read_ok:
            return Verdict.REMOTE_HIT, None
        if self.request_failed:
            return Verdict.REQUEST_FAILED, self.failed_reason or "request failed before the read completed"
        return Verdict.UNKNOWN, "read started but no completion was seen"

    def computed_tokens(self) -> int:
        """Prompt tokens P computed itself."""
        read = self.remote_read_tokens if self.read_ok else 0
        return max(self.prompt_tokens - self.local_hit_tokens - read, 0)

    def report(self, *, bidirectional: bool, threshold: int) -> PrefillReport:
        """The PrefillReport P returns under ``kv_transfer_params["kvdiag"]``."""
        return PrefillReport(**self.report_dict(bidirectional=bidirectional, threshold=threshold))

    def report_dict(self, *, bidirectional: bool, threshold: int) -> dict[str, Any]:
        """``report(...).to_dict()`` without building the frozen dataclass (the connector's finish hook)."""
        verdict, reason = self.outcome(bidirectional=bidirectional, threshold=threshold)
        read_ok = self.read_ok and self.failure_type is None
        out: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "engine_request_id": self.engine_request_id,
            "prompt_tokens": self.prompt_tokens,
            "local_hit_tokens": self.local_hit_tokens,
            "remote_offered_tokens": self.remote_offered_tokens,
            "remote_read_tokens": self.remote_read_tokens if read_ok else 0,
            "computed_tokens": self.computed_tokens(),
            "transfer_bytes": self.transfer_bytes,
            "transfer_ms": round(self.transfer_ms, 3),
            "outcome": verdict.value,
        }
        # the optional fields, only when set (as PrefillReport.to_dict)
        if self.engine_id is not None:
            out["engine_id"] = self.engine_id
        if reason is not None:
            out["reason"] = reason
        if self.failure_type is not None:
            out["failure_type"] = self.failure_type
        if self.remote_engine_id is not None:
            out["remote_engine_id"] = self.remote_engine_id
        if self.remote_request_id is not None:
            out["remote_request_id"] = self.remote_request_id
        if self.mismatch_tokens is not None:
            out["mismatch_tokens"] = self.mismatch_tokens
        return out
