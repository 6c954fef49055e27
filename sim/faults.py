"""Switches that make an emulated engine reproduce each real failure; settable at start and at runtime.

``POST /kvdiag/admin/faults`` takes a JSON object with any of these keys (unknown keys are an
error naming the known ones)::

    {"bidirectional_kv_xfer": false, "stream_kv_params": false, "prefix_caching": false,
     "kv_load_failure_policy": "recompute", "hang_on_recompute": true,
     "kv_recompute_threshold": 64, "fail_transfers": {"handshake_failed": 1.0}, "fail_requests": 0.1,
     "pull_matching_prefix": false}
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError

# vLLM's failure_type values for a reader (docs/vllm-reference.md, log lines);
# transfer_exception behaves as transfer_failed.
FAILURE_TYPES: Final = ("handshake_setup_failed", "handshake_failed", "transfer_failed", "transfer_setup_failed",
                        "notification_failed")
POLICIES: Final = ("fail", "recompute")


class FaultError(KVDiagError, ValueError):
    """A switch value that cannot be applied; the message names the key and the fix."""


def parse_fail_transfers(spec: str) -> dict[str, float]:
    """Parse ``TYPE[:RATE]`` (comma-separated) into {failure_type: rate}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rate_text = part.partition(":")
        if name not in FAILURE_TYPES:
            raise FaultError(f"--fail-transfers: unknown failure type {name!r}; use one of {', '.join(FAILURE_TYPES)}")
        try:
            rate = float(rate_text) if rate_text else 1.0
        except ValueError:
            raise FaultError(f"--fail-transfers: rate {rate_text!r} of {name} is not a number (use 0..1)") from None
        if not 0.0 <= rate <= 1.0:
            raise FaultError(f"--fail-transfers: rate {rate} of {name} must be between 0 and 1")
        out[name] = rate
    return out


@dataclass
class Faults:
    """The runtime switches of one engine."""

    bidirectional_kv_xfer: bool = True
    stream_kv_params: bool = True
    prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    hang_on_recompute: bool = False
    kv_recompute_threshold: int = 64
    fail_transfers: dict[str, float] = field(default_factory=dict)
    fail_requests: float = 0.0
    pull_matching_prefix: bool = True  # P's exact mode (instrumented); off for the negative control
    seed: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)
        self.validate()

    def validate(self) -> None:
        """Raise FaultError on a value out of range."""
        if self.kv_load_failure_policy not in POLICIES:
            raise FaultError(f"kv_load_failure_policy {self.kv_load_failure_policy!r}: use 'fail' or 'recompute'")
        if self.kv_recompute_threshold < 0:
            raise FaultError("kv_recompute_threshold must be >= 0")
        if not 0.0 <= self.fail_requests <= 1.0:
            raise FaultError("fail_requests must be a rate between 0 and 1")
        for name, rate in self.fail_transfers.items():
            if name not in FAILURE_TYPES or not 0.0 <= rate <= 1.0:
                raise FaultError(f"fail_transfers: {name}:{rate} (types {', '.join(FAILURE_TYPES)}, rate 0..1)")

    def update(self, changes: Any) -> dict[str, Any]:
        """Apply a JSON object of switches atomically; return the new state."""
        if not isinstance(changes, dict):
            raise FaultError("expected a JSON object of switches")
        known = {f.name: f for f in fields(self) if not f.name.startswith("_") and f.name != "seed"}
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise FaultError(f"unknown switch(es) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        saved = {k: getattr(self, k) for k in known}
        try:
            for key, value in changes.items():
                current = saved[key]
                if key == "fail_transfers" and isinstance(value, str):
                    value = parse_fail_transfers(value)
                if isinstance(current, bool):
                    if not isinstance(value, bool):
                        raise FaultError(f"{key}: expected true or false, got {value!r}")
                elif isinstance(current, int) and (isinstance(value, bool) or not isinstance(value, int)):
                    raise FaultError(f"{key}: expected an integer, got {value!r}")
                elif isinstance(current, float):
                    if isinstance(value, bool) or not isinstance(value, int | float):
                        raise FaultError(f"{key}: expected a number, got {value!r}")
                    value = float(value)
                elif isinstance(current, dict):
                    if not isinstance(value, dict):
                        raise FaultError(f"{key}: expected an object {{type: rate}}, got {value!r}")
                    value = {str(k): float(v) for k, v in value.items()}
                elif isinstance(current, str) and not isinstance(value, str):
                    raise FaultError(f"{key}: expected a string, got {value!r}")
                setattr(self, key, value)
            self.validate()
        except (FaultError, TypeError, ValueError) as exc:
            for k, v in saved.items():
                setattr(self, k, v)
            raise FaultError(str(exc)) from None
        return self.state()

    def state(self) -> dict[str, Any]:
        """The switches as JSON."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def transfer_failure(self) -> str | None:
        """The failure type to inject into the next read, if any (first matching type wins)."""
        for name in FAILURE_TYPES:
            rate = self.fail_transfers.get(name, 0.0)
            if rate > 0.0 and self._rng.random() < rate:
                return name
        return None

    def request_fails(self) -> bool:
        """Whether to fail the next request for a reason unrelated to KV reuse."""
        return self.fail_requests > 0.0 and self._rng.random() < self.fail_requests
