"""What P and D know about one request, and the verdict rule (docs/design.md, Contract 4).

Pure Python with no vLLM import, so the emulated engines (kvdiag.sim) and the real connector
(kvdiag.instrumentation.connector) share one rule and one report shape.

Usage::

    view = PrefillView(engine_request_id="cmpl-1-0", prompt_tokens=170, block_size=32,
                       has_handle=True, remote_offered_tokens=139, local_hit_tokens=0)
    view.read_started(tokens=139)
    view.read_done(transfer_bytes=983040, transfer_ms=4.2)
    report = view.report(bidirectional=True, threshold=64)   # PrefillReport, outcome remote_hit
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
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


# ---------------------------------------------------------------------------------------------
# Block-hash digest (vLLM issue #43094): D says which sequence it holds, P checks its prompt.

DIGEST_KEY: Final = "kvdiag_digest"
DIGEST_BYTES: Final = 4          # bytes kept per checkpoint (hex: 8 chars)
MAX_CHECKPOINTS: Final = 256     # bounds the params size whatever the sequence length


def tail_hash(parent: bytes, tokens: Sequence[int]) -> str:
    """The digest's end checkpoint: the last full block's hash chained with the tokens after it."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()[:DIGEST_BYTES].hex()


def make_digest(block_hashes: Sequence[bytes], block_size: int, count: int | None = None,
                tail: Sequence[int] | None = None) -> dict[str, Any]:
    """A compact digest of the first ``count`` (default: all) chained block hashes: a short
    prefix of every ``stride``-th hash, and with ``tail`` (the < block_size tokens held after those
    blocks) an end checkpoint over the last block's hash and those tokens.

    vLLM's block hashes chain the parent's hash, so equal hashes at block ``i`` mean equal
    tokens in blocks ``0..i``; a checkpoint every ``stride`` blocks bounds the first divergence
    to one stride, and the end checkpoint proves the whole held sequence (the blocks after the
    last stride checkpoint and the partial block). Only the checkpoint hashes are touched.
    """
    n = len(block_hashes) if count is None else max(0, min(count, len(block_hashes)))
    stride = max(1, -(-n // MAX_CHECKPOINTS))
    checkpoints = [h[:DIGEST_BYTES].hex() for h in block_hashes[stride - 1:n:stride]]
    digest: dict[str, Any] = {"block_size": block_size, "stride": stride, "blocks": n, "h": checkpoints}
    if tail is not None and n >= 1 and len(tail) < block_size:
        digest["tail"] = {"n": len(tail), "h": tail_hash(block_hashes[n - 1], tail)}
    return digest


class DigestError(ValueError):
    """A digest received in kv_transfer_params is malformed (client-supplied: never trusted)."""


# A parsed digest: (block_size, stride, blocks, checkpoints as bytes, tail tokens or -1, tail hex or "").
_Digest = tuple[int, int, int, bytes, int, str]
_MAX_FIELD: Final = 10_000_000


def _parse_digest(obj: Any) -> _Digest:
    # Runs once per P request with a handle: plain type checks, one join and one hex decode.
    if type(obj) is not dict:
        raise DigestError("digest must be an object")
    block_size, stride, blocks, hashes = obj.get("block_size"), obj.get("stride"), obj.get("blocks"), obj.get("h")
    for name, value in (("block_size", block_size), ("stride", stride), ("blocks", blocks)):
        if type(value) is not int or not 0 <= value <= _MAX_FIELD:
            raise DigestError(f"digest field {name!r} must be a small non-negative integer")
    if type(hashes) is not list or len(hashes) > MAX_CHECKPOINTS:
        raise DigestError(f"digest field 'h' must be a list of at most {MAX_CHECKPOINTS} strings")
    try:
        raw = bytes.fromhex("".join(hashes))
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != DIGEST_BYTES * len(hashes) or (hashes and set(map(len, hashes)) != {2 * DIGEST_BYTES}):
        raise DigestError("digest checkpoints must be hex strings of 8 characters")
    assert isinstance(block_size, int) and isinstance(stride, int) and isinstance(blocks, int)
    if stride < 1 or len(hashes) != blocks // stride:
        raise DigestError("digest checkpoint count does not match blocks/stride")
    tail = obj.get("tail")
    if tail is None:
        return block_size, stride, blocks, raw, -1, ""
    n, h = (tail.get("n"), tail.get("h")) if type(tail) is dict else (None, None)
    if type(n) is not int or not 0 <= n < block_size or blocks < 1 or type(h) is not str \
            or len(h) != 2 * DIGEST_BYTES:
        raise DigestError("digest field 'tail' must be {\"n\": tokens below block_size, \"h\": 8 hex characters}")
    return block_size, stride, blocks, raw, n, h


def first_mismatch(digest: Any, prompt_hashes: Sequence[bytes], block_size: int) -> tuple[int | None, int]:
    """Compare D's digest with P's prompt block hashes.

    Returns ``(first_diverging_block or None, matching_blocks)``: the first block (0-based) that is
    known to differ, and how many leading blocks are known to match (a multiple of the stride).
    Only the blocks both sides hold are compared. Raises DigestError on a malformed digest.
    """
    d_block_size, stride, _blocks, raw, _n, _h = _parse_digest(digest)
    if d_block_size != block_size:
        raise DigestError(f"digest block_size {d_block_size} differs from P's {block_size}")
    return _compare(stride, raw, prompt_hashes, len(prompt_hashes))


def _compare(stride: int, raw: bytes, prompt_hashes: Sequence[bytes], limit: int) -> tuple[int | None, int]:
    """Checkpoints of blocks below ``limit``: (first block not proven on a difference, matched blocks)."""
    indices = range(stride - 1, min(limit, len(raw) // DIGEST_BYTES * stride), stride)
    mine = b"".join([prompt_hashes[i][:DIGEST_BYTES] for i in indices])
    if mine == raw[:len(mine)]:
        return None, indices[-1] + 1 if indices else 0
    for k in range(len(indices)):   # find the first differing checkpoint (rare: a real mismatch)
        at = k * DIGEST_BYTES
        if mine[at:at + DIGEST_BYTES] != raw[at:at + DIGEST_BYTES]:
            return k * stride, k * stride
    raise AssertionError("unreachable: the joined checkpoints differ")


@dataclass(slots=True)
class PrefixCheck:
    """What P's block-hash check proved about the tokens a D handle offers."""

    offered_tokens: int            # min(remote_num_tokens, prompt): what vLLM would read
    proven_tokens: int             # leading tokens of those proven equal to D's sequence
    matched_blocks: int            # leading full blocks proven equal
    mismatch_block: int | None     # first block not proven, when a comparison failed

    @property
    def mismatch_tokens(self) -> int:
        """Offered tokens past the proven prefix when the check found a divergence."""
        return self.offered_tokens - self.proven_tokens if self.mismatch_block is not None else 0

    @property
    def unverified_tokens(self) -> int:
        """Offered tokens the digest cannot vouch for although nothing diverged (granularity)."""
        return self.offered_tokens - self.proven_tokens if self.mismatch_block is None else 0


def check_prefix(digest: Any, prompt_hashes: Sequence[bytes], prompt_tokens: Sequence[int] | None, block_size: int,
                 remote_num_tokens: int) -> PrefixCheck:
    """Prove the longest prefix of P's prompt equal to the sequence D holds, within what the handle offers.

    Only blocks that D holds in full, that lie inside ``remote_num_tokens`` (a router may have
    trimmed the handle) and that the prompt holds in full are compared; the end checkpoint then
    proves D's partial last block when the handle and the prompt both reach its end.
    ``prompt_tokens`` None (no token ids, e.g. prompt embeddings) skips the end checkpoint. Raises
    DigestError on a malformed digest or a block size that differs from P's.
    """
    d_block_size, stride, blocks, raw, tail_tokens, tail = _parse_digest(digest)
    if d_block_size != block_size:
        raise DigestError(f"digest block_size {d_block_size} differs from P's {block_size}")
    prompt_len = len(prompt_tokens) if prompt_tokens is not None else len(prompt_hashes) * block_size
    offered = max(0, min(remote_num_tokens, prompt_len))
    limit = min(blocks, len(prompt_hashes), max(remote_num_tokens, 0) // block_size)
    mismatch, matched = _compare(stride, raw, prompt_hashes, limit)
    proven = matched * block_size
    if mismatch is None and tail_tokens >= 0 and limit == blocks and prompt_tokens is not None:
        start = blocks * block_size
        end = start + tail_tokens
        if end <= remote_num_tokens and end <= prompt_len:
            if tail_hash(prompt_hashes[blocks - 1], prompt_tokens[start:end]) == tail:
                matched, proven = blocks, end
            else:
                mismatch = matched
    return PrefixCheck(offered_tokens=offered, proven_tokens=min(proven, offered), matched_blocks=matched,
                       mismatch_block=mismatch)
