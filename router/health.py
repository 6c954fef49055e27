"""Upstream health: passive ejection of failing P/D instances, timed re-admission, an optional ``/health`` probe.

An instance that fails ``eject_after`` requests in a row (connect errors, timeouts, HTTP 5xx) is
ejected: placement sends it traffic only when every instance of its role is ejected (a router
that refuses a turn it could still try would be worse than a slow one). After ``eject_seconds``
it is re-admitted on probation: one more failure ejects it again for twice as long (up to
``max_eject_seconds``), one success clears its record. With an active probe, ``GET /health``
runs every ``interval`` seconds per instance; a failed probe counts like a failed request and a
passing probe re-admits an ejected instance at once (Envoy's outlier detection and active health
checking behave the same way).

A prefill that fails with a 5xx while it carried D's handle is not counted: vLLM answers a failed
D->P read with a 500, and that failure belongs to the handle (an expired or restarted D), not to P.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from yarl import URL

from kvdiag.exporters.prometheus import OTHER, CatalogMetrics

_logger = logging.getLogger(__name__)

LEGS: Final = ("prefill", "decode")
# Request failures that say something about the instance (the catalog's EJECTION_REASONS add "probe").
COUNTED_KINDS: Final = frozenset({"connect", "timeout", "http_5xx"})
MAX_INDEX_LABELS: Final = 128  # instance-index label values beyond this fold into "other"


def index_label(index: int) -> str:
    """The bounded ``index`` label value of instance ``index``."""
    return str(index) if 0 <= index < MAX_INDEX_LABELS else OTHER


@dataclass
class _State:
    failures: int = 0          # counted failures in a row
    ejected_until: float = 0.0  # clock time; 0: admitted
    ejections: int = 0         # ejections since the last success (the backoff exponent)


class UpstreamHealth:
    """Per-instance health of every P and D, shared by the placement policies of one router process."""

    def __init__(self, sizes: dict[str, int], *, eject_after: int, eject_seconds: float, max_eject_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.eject_after = eject_after
        self.eject_seconds = eject_seconds
        self.max_eject_seconds = max_eject_seconds
        self._clock = clock
        self._states = {leg: [_State() for _ in range(sizes.get(leg, 0))] for leg in LEGS}
        self._metrics: CatalogMetrics | None = None

    def bind_metrics(self, metrics: CatalogMetrics) -> None:
        """Export the gauges and counters through ``metrics`` (every instance starts healthy)."""
        self._metrics = metrics
        for leg, states in self._states.items():
            for index in range(len(states)):
                self._gauge(leg, index, 1)

    # ------------------------------------------------------------------ queries
    def admitted(self, leg: str, index: int) -> bool:
        """True unless the instance is ejected; an ejection that ran out re-admits it (on probation)."""
        state = self._states[leg][index]
        if state.ejected_until == 0.0:
            return True
        if self._clock() < state.ejected_until:
            return False
        self._readmit(leg, index, "timer")
        return True

    def order(self, leg: str, preferred: list[int]) -> list[int]:
        """``preferred`` with the ejected instances moved last, soonest re-admission first."""
        admitted = [i for i in preferred if self.admitted(leg, i)]
        if len(admitted) == len(preferred):
            return preferred
        ejected = sorted((i for i in preferred if i not in admitted),
                         key=lambda i: self._states[leg][i].ejected_until)
        return admitted + ejected

    def ejected(self, leg: str) -> list[int]:
        """Indexes currently ejected."""
        return [i for i in range(len(self._states[leg])) if not self.admitted(leg, i)]

    # ------------------------------------------------------------------ outcomes
    def success(self, leg: str, index: int) -> None:
        """A request (or probe) the instance answered: its record is cleared."""
        state = self._states[leg][index]
        if state.failures or state.ejections:
            state.failures = 0
            state.ejections = 0

    def failure(self, leg: str, index: int, kind: str) -> bool:
        """Count a failure of ``kind``; return True when it ejected the instance."""
        if self.eject_after <= 0 or (kind not in COUNTED_KINDS and kind != "probe"):
            return False
        state = self._states[leg][index]
        if state.ejected_until and self._clock() < state.ejected_until:
            return False  # already out (a request that was tried as a last resort)
        state.failures += 1
        if state.failures < self.eject_after:
            return False
        seconds = min(self.eject_seconds * 2 ** state.ejections, self.max_eject_seconds)
        state.ejections += 1
        state.ejected_until = self._clock() + seconds
        _logger.warning("%s instance %d ejected for %.0f s after %d failures in a row (last: %s)", leg, index,
                        seconds, state.failures, kind)
        self._gauge(leg, index, 0)
        self._count("kvdiag_upstream_ejections", leg, index, reason=kind)
        return True

    def probe_result(self, leg: str, index: int, ok: bool) -> None:
        """An active ``/health`` probe's answer."""
        state = self._states[leg][index]
        if not ok:
            self.failure(leg, index, "probe")
            return
        if state.ejected_until:
            self._readmit(leg, index, "probe")
        self.success(leg, index)

    def _readmit(self, leg: str, index: int, trigger: str) -> None:
        state = self._states[leg][index]
        state.ejected_until = 0.0
        # Probation: the next counted failure ejects again (for longer) unless a success comes first.
        state.failures = max(self.eject_after - 1, 0)
        _logger.info("%s instance %d re-admitted (%s)", leg, index, trigger)
        self._gauge(leg, index, 1)
        self._count("kvdiag_upstream_readmissions", leg, index, trigger=trigger)

    # ------------------------------------------------------------------ telemetry
    def _gauge(self, leg: str, index: int, value: int) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.labels("kvdiag_upstream_healthy", leg=leg, index=index_label(index)).set(value)
        except Exception:  # telemetry never breaks routing
            _logger.warning("upstream health gauge failed", exc_info=True)

    def _count(self, name: str, leg: str, index: int, **labels: str) -> None:
        if self._metrics is None:
            return
        try:
            self._metrics.labels(name, leg=leg, index=index_label(index), **labels).inc()
        except Exception:
            _logger.warning("upstream health counter failed", exc_info=True)


async def probe_forever(health: UpstreamHealth, session: aiohttp.ClientSession, urls: dict[str, list[URL]], *,
                        interval: float, timeout: float) -> None:
    """Probe every instance's ``/health`` each ``interval`` seconds until cancelled."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)

    async def probe(leg: str, index: int, url: URL) -> None:
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with session.get(url, timeout=client_timeout) as resp:
                await resp.read()
                ok = resp.status == 200
        health.probe_result(leg, index, ok)

    while True:
        jobs: list[Any] = [probe(leg, i, url) for leg, group in urls.items() for i, url in enumerate(group)]
        await asyncio.gather(*jobs, return_exceptions=True)
        await asyncio.sleep(interval)
