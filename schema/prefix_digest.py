"""The block-hash digest (vLLM issue #43094): D says which token sequence it holds, P proves its prompt
against it before reading.

Part of the D->P wire contract (``kv_transfer_params["kvdiag_digest"]``), shared by the emulated
engines and the real connector. Pure Python, no vLLM import.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError

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


class DigestError(KVDiagError, ValueError):
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
