"""Pure inferences from what the probes saw: block sizes from block lists, clock skew, TTL margins.

No I/O here, so each rule is tested on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

# P declines a D->P read when D's deadline is within this many seconds (vLLM pull_worker.py).
EXPIRY_SAFETY_MARGIN_S: Final = 5.0
MAX_BLOCK_SIZE: Final = 4096


@dataclass(frozen=True)
class BlockSizeRange:
    """The block sizes consistent with every (tokens, blocks) pair an engine returned: ``lo <= size <= hi``."""

    lo: int
    hi: int

    @property
    def empty(self) -> bool:
        """True if no block size fits every observation."""
        return self.lo > self.hi

    def powers_of_two(self) -> list[int]:
        """The powers of two inside the range (vLLM's block sizes are, for attention backends)."""
        return [1 << k for k in range(13) if self.lo <= (1 << k) <= self.hi]

    def best(self) -> int | None:
        """The block size when the observations pin it to one value or one power of two."""
        if self.empty:
            return None
        if self.lo == self.hi:
            return self.lo
        powers = self.powers_of_two()
        return powers[0] if len(powers) == 1 else None

    def describe(self) -> str:
        """``16`` or ``15..17``."""
        best = self.best()
        if best is not None:
            return str(best)
        return "none" if self.empty else f"{self.lo}..{self.hi}"


def block_size_range(observations: Iterable[tuple[int, int]], slack_tokens: int = 0) -> BlockSizeRange:
    """Block sizes ``b`` with ``ceil(n / b) <= k <= ceil((n + slack) / b)`` for every ``(n tokens, k blocks)``.

    P's blocks cover exactly its prompt (slack 0). D may hold one slot beyond the tokens it
    computed (the last sampled token), so D's observations use ``slack_tokens=1``.
    """
    lo, hi = 1, MAX_BLOCK_SIZE
    for n, k in observations:
        if n <= 0 or k <= 0:
            continue
        # ceil(n / b) <= k  <=>  b >= n / k
        lo = max(lo, math.ceil(n / k))
        # k <= ceil((n + slack) / b)  <=>  (k - 1) * b < n + slack
        if k > 1:
            hi = min(hi, math.ceil((n + slack_tokens) / (k - 1)) - 1)
    return BlockSizeRange(lo, hi)


def handle_observation(params: Any) -> tuple[int, int] | None:
    """``(remote_num_tokens, len(first block group))`` of a kv_transfer_params dict, if both are there."""
    if not isinstance(params, dict):
        return None
    n = params.get("remote_num_tokens")
    groups = params.get("remote_block_ids")
    if isinstance(n, bool) or not isinstance(n, int) or not isinstance(groups, list) or not groups:
        return None
    first = groups[0]
    if not isinstance(first, list) or not first:
        return None
    return n, len(first)


def ranges_agree(p: BlockSizeRange, d: BlockSizeRange) -> bool | None:
    """True/False when the two engines' block sizes are known to agree/differ; None when undecided."""
    if p.empty or d.empty:
        return None
    pb, db = p.best(), d.best()
    if pb is not None and db is not None:
        return pb == db
    if p.hi < d.lo or d.hi < p.lo:
        return False
    return None


@dataclass(frozen=True)
class Skew:
    """A component's wall-clock offset from ours: the true offset lies in ``[low, high]`` seconds."""

    component: str
    low: float
    high: float

    def beyond(self, limit: float) -> bool:
        """True if the clock is off by more than ``limit`` seconds for certain."""
        return self.low > limit or self.high < -limit

    def describe(self) -> str:
        """The offset as a short phrase."""
        mid = (self.low + self.high) / 2
        return f"{self.component} {mid:+.1f} s (±{(self.high - self.low) / 2:.1f})"


def clock_skews(samples: Sequence[Any]) -> list[Skew]:
    """Per component, the tightest bounds on its clock offset from a list of ClockSample-like objects.

    A ``Date`` header is the remote second, truncated: remote time ∈ [date, date + 1). The call
    happened between ``local_before`` and ``local_after``, so offset ∈ [date - after, date + 1 - before].
    """
    bounds: dict[str, tuple[float, float]] = {}
    for s in samples:
        low, high = s.remote - s.local_after, s.remote + 1.0 - s.local_before
        old = bounds.get(s.component)
        bounds[s.component] = (low, high) if old is None else (max(old[0], low), min(old[1], high))
    return [Skew(name, low, high) for name, (low, high) in bounds.items()]


def ttl_from_expiry(expiry: float, remote_now: float, seconds_since_reply: float) -> float:
    """D's TTL: how long the blocks it returned are still held, plus the time since it returned them."""
    return expiry - remote_now + seconds_since_reply


def router_ttl_problem(entry_ttl: float, decoder_ttl: float) -> str | None:
    """Why a router entry TTL does not work with a decoder TTL (None if it does)."""
    if decoder_ttl <= EXPIRY_SAFETY_MARGIN_S:
        return (f"decoder_kv_blocks_ttl {decoder_ttl:g} s is not above P's {EXPIRY_SAFETY_MARGIN_S:g} s "
                "expiry margin: P declines every D->P read")
    if entry_ttl >= decoder_ttl - EXPIRY_SAFETY_MARGIN_S:
        return (f"entry TTL {entry_ttl:g} s is not below decoder_kv_blocks_ttl {decoder_ttl:g} s - "
                f"{EXPIRY_SAFETY_MARGIN_S:g} s: a turn arriving {decoder_ttl - EXPIRY_SAFETY_MARGIN_S:g}-"
                f"{entry_ttl:g} s after the previous one gets a handle P declines or whose blocks D freed")
    return None


def suggest_entry_ttl(decoder_ttl: float) -> float:
    """An entry TTL that works with ``decoder_ttl``: the router's default (TTL - 30 s), or 1 s inside the margin."""
    if decoder_ttl - 30 > EXPIRY_SAFETY_MARGIN_S:
        return float(round(decoder_ttl - 30))
    return max(1.0, float(int(decoder_ttl - EXPIRY_SAFETY_MARGIN_S - 1)))
