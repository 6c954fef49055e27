"""Placement: which P and which D serve a turn.

Two policies (``--policy``):

* ``round-robin`` (the default, the example proxy's): independent cursors over P and D;
* ``kv-aware``: follow the conversation's KV.

  - **decode affinity**: the D that served the conversation's last turn, while it is admitted
    (router/health.py) and under the load bound. Its prefix cache still holds the conversation's
    sequence, so the P->D pull moves only the tokens it lacks instead of the whole prompt;
  - **prefill locality** (``prefill_locality``, for Ps with prefix caching): the P that served the
    last turn, under the same conditions. It holds the previous prompt, so P reads from D only what
    its cache lacks (often nothing);
  - **branches**: a turn that arrives while another turn of the conversation is in flight (parallel
    tool calls, a duplicate, a sub-agent reusing the id) gets no handle (a handle is read once). It
    waits, at most ``branch_wait`` seconds, for the leader's prefill on this router to finish and goes
    to the same P, whose cache then holds the history the leader just read;
  - otherwise, and whenever the preferred instance is ejected or overloaded: the admitted instance with
    the least in flight (estimated prompt tokens on P, turns on D), ties broken round-robin.

  The load bound is the one of consistent hashing with bounded loads: an instance keeps its affinity
  while its load does not exceed ``load_factor`` times the mean load of the admitted instances
  (counting this turn) plus this turn's own load, so no instance becomes a hot spot.

The conversation's last P and D are the ``prefill``/``decode`` addresses of its last-turn record in
the store, so every router replica sharing the store places alike. Placement only decides where a
request runs; what P may read from D's handle is the reuse rule's decision alone.

Each turn's decision (per leg: the chosen index, the reason and the tokens the chosen instance is
expected to hold already) goes into the ``router_turn`` event (``attrs.placement``) and the
``kvdiag_placement_*`` metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.exporters.prometheus import CatalogMetrics
from kvdiag.router.config import RouterConfig
from kvdiag.router.health import index_label
from kvdiag.router.reuse_rule import Coverage, Decision, Reuse
from kvdiag.router.store import Claim
from kvdiag.router.upstream import Upstreams

_logger = logging.getLogger(__name__)

ROUND_ROBIN: Final = "round-robin"
KV_AWARE: Final = "kv-aware"
# Why an instance was chosen (the catalog's PLACEMENT_REASONS).
REASON_ROUND_ROBIN: Final = "round_robin"
REASON_AFFINITY: Final = "affinity"
REASON_LOCALITY: Final = "locality"
REASON_BRANCH: Final = "branch"
REASON_LEAST_LOADED: Final = "least_loaded"
REASON_OVERLOADED: Final = "overloaded"
REASON_UNHEALTHY: Final = "fallback_unhealthy"
BYTES_PER_TOKEN: Final = 4  # a request's prompt tokens, estimated from its body size (only loads are compared)
MAX_LEADERS: Final = 100_000  # in-flight conversations tracked for branch placement


@dataclass
class LegChoice:
    """Where one leg goes: the order to try (the choice first), why, and the tokens expected there already."""

    order: list[int]
    reason: str
    preferred: int | None = None  # the instance the conversation's KV points at (None: none known)
    expected_local_tokens: int | None = None  # None: not known

    @property
    def index(self) -> int:
        """The chosen instance."""
        return self.order[0]

    def attrs(self) -> dict[str, Any]:
        """The event's view of the choice."""
        out: dict[str, Any] = {"index": self.index, "reason": self.reason}
        if self.expected_local_tokens is not None:
            out["expected_local_tokens"] = self.expected_local_tokens
        return out


@dataclass
class _Leader:
    prefill: int
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Placed:
    """One turn's placement, from the prefill choice to the end of the turn."""

    policy: str
    key: str | None
    load_tokens: int
    prefill: LegChoice
    decode: LegChoice | None = None
    last_decode: int | None = None  # this router's index of the D that served the last turn
    leader: _Leader | None = None  # set while this turn leads its conversation's in-flight turns
    decoding: int | None = None  # the D counted as busy with this turn
    local_p: int | None = None  # tokens the last P is expected to hold (from the reuse decision)
    local_d: int | None = None  # tokens the last D is expected to hold
    finished: bool = False

    def attrs(self) -> dict[str, Any]:
        """``attrs.placement`` of the turn's event."""
        out: dict[str, Any] = {"policy": self.policy, "prefill": self.prefill.attrs()}
        if self.decode is not None:
            out["decode"] = self.decode.attrs()
        return out


class Placement:
    """The placement policy of one router process."""

    def __init__(self, config: RouterConfig, upstreams: Upstreams, metrics: CatalogMetrics | None = None) -> None:
        self.config = config
        self.policy = config.policy
        self.upstreams = upstreams
        self.metrics = metrics
        self._leaders: dict[str, _Leader] = {}
        self._children: dict[tuple[str, ...], Any] = {}
        if metrics is not None:
            upstreams.bind_metrics(metrics)

    # ------------------------------------------------------------------ prefill
    async def prefill(self, key: str | None, claim: Claim | None, body_bytes: int) -> Placed:
        """Choose the turn's P (waiting for a branch's leader when that is the plan)."""
        tokens = max(body_bytes // BYTES_PER_TOKEN, 1)
        last = claim.last if claim is not None else None
        last_p = self.upstreams.index_of("prefill", last.prefill) if last is not None else None
        last_d = self.upstreams.index_of("decode", last.decode) if last is not None else None
        if self.policy != KV_AWARE:
            placed = Placed(self.policy, key, tokens, self._round_robin("prefill", last_p), last_decode=last_d)
        else:
            placed = await self._kv_prefill(key, claim, tokens, last_p, last_d)
            if key is not None and claim is not None and claim.acquired and len(self._leaders) < MAX_LEADERS:
                placed.leader = self._leaders[key] = _Leader(placed.prefill.index)
        return placed

    def _round_robin(self, leg: str, preferred: int | None) -> LegChoice:
        rotation = self.upstreams.rotation(leg)
        order = self.upstreams.health.order(leg, rotation)
        return LegChoice(order, REASON_ROUND_ROBIN if order[0] == rotation[0] else REASON_UNHEALTHY, preferred)

    async def _kv_prefill(self, key: str | None, claim: Claim | None, tokens: int, last_p: int | None,
                          last_d: int | None) -> Placed:
        preferred, reason = None, REASON_LOCALITY
        if self.config.prefill_locality and key is not None:
            leader = self._leaders.get(key) if claim is not None and not claim.acquired else None
            if leader is not None:
                wait = min(self.config.branch_wait, self.config.prefill_timeout)
                if not leader.done.is_set() and wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(leader.done.wait(), wait)
                preferred, reason = leader.prefill, REASON_BRANCH
            else:
                preferred = last_p
        load = self.upstreams.prefill_tokens
        order, why = self._choose("prefill", preferred, [float(x) for x in load], float(tokens))
        return Placed(KV_AWARE, key, tokens, LegChoice(order, reason if why is None else why, preferred),
                      last_decode=last_d)

    # ------------------------------------------------------------------ decode
    def decode_order(self, placed: Placed) -> list[int]:
        """Choose the turn's D; return the indexes to try (the choice first)."""
        if self.policy != KV_AWARE:
            placed.decode = self._round_robin("decode", placed.last_decode)
        else:
            load = [float(x) for x in self.upstreams.decode_turns]
            order, why = self._choose("decode", placed.last_decode, load, 1.0)
            placed.decode = LegChoice(order, REASON_AFFINITY if why is None else why, placed.last_decode)
        self._expect(placed)
        return placed.decode.order

    def _choose(self, leg: str, preferred: int | None, load: list[float],
                weight: float) -> tuple[list[int], str | None]:
        """The order to try and, when the preferred instance was not taken, why (None: it was)."""
        health = self.upstreams.health
        n = len(load)
        admitted = [i for i in range(n) if health.admitted(leg, i)]
        why: str | None = None
        if preferred is not None and 0 <= preferred < n:
            if preferred not in admitted:
                why = REASON_UNHEALTHY
            elif self._overloaded(load, admitted, preferred, weight):
                why = REASON_OVERLOADED
            else:
                rest = sorted((i for i in admitted if i != preferred), key=lambda i: load[i])
                return [preferred, *rest, *health.order(leg, [i for i in range(n) if i not in admitted])], None
        else:
            why = REASON_LEAST_LOADED
        start = self.upstreams.next_cursor(leg)
        pool = admitted or list(range(n))  # every instance ejected: try them all, soonest back first
        ranked = sorted(pool, key=lambda i: (load[i], (i - start) % n))
        if not admitted:
            ranked = health.order(leg, ranked)
        return [*ranked, *health.order(leg, [i for i in range(n) if i not in ranked])], why

    def _overloaded(self, load: list[float], admitted: list[int], index: int, weight: float) -> bool:
        # Bounded loads: the preferred instance keeps the turn unless it already holds more than load_factor
        # times the mean load the admitted instances will have with this turn placed, plus one turn's worth
        # (the slack bounded-load consistent hashing gets from rounding up, so a few turns never count as a
        # hot spot).
        mean_after = (sum(load[i] for i in admitted) + weight) / max(len(admitted), 1)
        return load[index] > self.config.load_factor * mean_after + weight

    # ------------------------------------------------------------------ expectations
    def expect(self, placed: Placed, decision: Decision | None, coverage: Coverage | None) -> None:
        """Note how many tokens the last P and D hold that this prompt reproduces (the proven prefix)."""
        if decision is None or decision.reuse is Reuse.NONE:
            return
        placed.local_d = decision.limit_tokens
        previous_prompt = coverage.rungs[-1].tokens if coverage is not None and coverage.rungs else None
        placed.local_p = min(decision.limit_tokens, previous_prompt) if previous_prompt is not None else None
        self._expect(placed)

    def _expect(self, placed: Placed) -> None:
        p = placed.prefill
        if not self.config.prefill_locality:
            p.expected_local_tokens = 0  # P keeps no prefix cache
        elif p.reason == REASON_BRANCH and p.index == p.preferred:
            p.expected_local_tokens = None  # what the leader read; its prompt is not this one
        elif p.preferred is not None:
            p.expected_local_tokens = placed.local_p if p.index == p.preferred else 0
        d = placed.decode
        if d is not None and d.preferred is not None:
            d.expected_local_tokens = placed.local_d if d.index == d.preferred else 0

    # ------------------------------------------------------------------ turn lifecycle
    def prefill_done(self, placed: Placed | None, served: int | None = None) -> None:
        """The turn's prefill leg ended (on P ``served``, when it succeeded): branches waiting for it may go."""
        if placed is not None and placed.leader is not None:
            if served is not None:
                placed.leader.prefill = served  # a failover: the history is on the P that answered
            placed.leader.done.set()
            if self._leaders.get(placed.key or "") is placed.leader:
                del self._leaders[placed.key or ""]
            placed.leader = None

    def decode_started(self, placed: Placed | None, index: int) -> None:
        """The decode leg opened on D ``index``."""
        if placed is not None:
            placed.decoding = index
            if placed.decode is not None and placed.decode.index != index:
                placed.decode.expected_local_tokens = 0 if placed.decode.preferred is not None else None
        self.upstreams.decode_started(index)

    def finish(self, placed: Placed | None, attrs: dict[str, Any]) -> None:
        """End the turn: free its load, record the decision in ``attrs`` and the metrics (once)."""
        if placed is None or placed.finished:
            return
        placed.finished = True
        self.prefill_done(placed)
        if placed.decoding is not None:
            self.upstreams.decode_done(placed.decoding)
            placed.decoding = None
        try:
            attrs["placement"] = placed.attrs()
            if self.metrics is None:
                return
            for leg, choice in (("prefill", placed.prefill), ("decode", placed.decode)):
                if choice is None:
                    continue
                self._counter("kvdiag_placement_decisions", leg=leg, reason=choice.reason,
                              index=index_label(choice.index)).inc()
                if choice.expected_local_tokens:
                    self._counter("kvdiag_placement_expected_local_tokens", leg=leg).inc(
                        choice.expected_local_tokens)
        except Exception:  # telemetry never breaks a turn
            _logger.warning("recording the placement failed", exc_info=True)

    def _counter(self, name: str, **labels: str) -> Any:
        key = (name, *labels.values())
        child = self._children.get(key)
        if child is None:
            assert self.metrics is not None
            child = self._children[key] = self.metrics.labels(name, **labels)
        return child
