"""What a live check reports: one Finding per fact, their statuses, and the process exit code.

Exit codes (documented in docs/deploy.md and ``kvdiag check --help``):

* 0: nothing failed (``info`` and ``cannot tell`` results allowed, unless ``strict``);
* 1: at least one check failed (a misconfiguration was found), or, with ``strict``, a result was
  ``warn`` or ``cannot tell``;
* 2: bad command-line usage (click's own code);
* 3: the check could not run: a component given did not answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

from kvdiag.schema.errors import KVDiagError

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
REPORT_VERSION: Final = 1


class CheckError(KVDiagError):
    """Base of the live check's errors."""


class Unreachable(CheckError):
    """A component did not answer (connection refused, timeout, or an HTTP error on a basic endpoint)."""

    def __init__(self, component: str, url: str, reason: str) -> None:
        super().__init__(f"{component} at {url} did not answer: {reason}")
        self.component = component
        self.url = url
        self.reason = reason


class Status(enum.StrEnum):
    """How one check came out, best first."""

    PASS = "pass"
    INFO = "info"          # a fact worth knowing, not a fault
    SKIPPED = "skipped"    # not run: a component was not given, or an earlier failure blocks it
    UNKNOWN = "unknown"    # cannot tell from outside
    WARN = "warn"
    FAIL = "fail"


_RANK: Final = {Status.PASS: 0, Status.INFO: 1, Status.SKIPPED: 2, Status.UNKNOWN: 3, Status.WARN: 4,
                Status.FAIL: 5}


@dataclass
class Finding:
    """One checked fact: its status, what was seen, and the fix when it is not right."""

    id: str
    title: str
    status: Status
    detail: str
    fix: str | None = None
    evidence: list[str] = field(default_factory=list)

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON form (``kvdiag check --json``)."""
        return {"id": self.id, "title": self.title, "status": self.status.value, "detail": self.detail,
                "fix": self.fix, "evidence": list(self.evidence)}


# The checks in report order, with their titles: a stable list, so a JSON consumer can rely on the ids.
CHECKS: Final[dict[str, str]] = {
    "prefill_reachable": "P answers (/v1/models, /metrics)",
    "decode_reachable": "D answers (/v1/models, /metrics)",
    "router_reachable": "Router answers (/health, /metrics)",
    "models": "P and D serve the same model",
    "pd_handoff": "P hands its KV to D (P/D disaggregation)",
    "stream_kv_params": "D streams kv_transfer_params (vLLM PR #40186)",
    "bidirectional_decode": "bidirectional_kv_xfer on D (D returns its blocks)",
    "bidirectional_prefill": "bidirectional_kv_xfer on P (P reads D's blocks)",
    "d2p_read": "A D->P read happened and succeeded",
    "prefix_caching_prefill": "P's prefix caching",
    "block_size": "P and D use the same block size",
    "decode_ttl": "D's decoder_kv_blocks_ttl above 5 s",
    "router_ttl": "Router entry TTL < decoder_kv_blocks_ttl - 5 s",
    "router_decode_ttl": "Router's decoder_kv_blocks_ttl matches D's",
    "conversation_id": "The conversation id reaches the router",
    "router_state": "The router keeps the conversation between turns",
    "request_ids": "Request ids correlate (X-Request-Id -> chatcmpl-<id>)",
    "clocks": "Clocks of the components agree",
}


@dataclass
class CheckReport:
    """Every finding of one run, in report order, and what it means for the exit code."""

    targets: dict[str, str | None]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    unreachable: bool = False

    def get(self, check_id: str) -> Finding | None:
        """The finding with ``check_id``, if that check ran."""
        return next((f for f in self.findings if f.id == check_id), None)

    def failed(self) -> list[Finding]:
        """The failed findings."""
        return [f for f in self.findings if f.status is Status.FAIL]

    def counts(self) -> dict[str, int]:
        """How many findings have each status."""
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.status.value] = out.get(f.status.value, 0) + 1
        return out

    def exit_code(self, strict: bool = False) -> int:
        """0 ok, 1 a check failed (or, strict, warned or could not tell), 3 a component did not answer."""
        if self.unreachable:
            return EXIT_UNREACHABLE
        bad = {Status.FAIL, Status.WARN, Status.UNKNOWN} if strict else {Status.FAIL}
        return EXIT_FAILED if any(f.status in bad for f in self.findings) else EXIT_OK

    def to_json_dict(self, strict: bool = False) -> dict[str, Any]:
        """The JSON document ``kvdiag check --json`` prints."""
        code = self.exit_code(strict)
        return {"version": REPORT_VERSION, "ok": code == EXIT_OK, "exit_code": code, "targets": self.targets,
                "summary": self.counts(), "checks": [f.to_json_dict() for f in self.findings],
                "notes": list(self.notes)}


class Findings:
    """Collects findings while probing; a check reported twice keeps the worse result and both evidences."""

    def __init__(self) -> None:
        self._by_id: dict[str, Finding] = {}

    def add(self, check_id: str, status: Status, detail: str, fix: str | None = None,
            evidence: list[str] | None = None) -> Finding:
        """Record ``check_id``'s result (merged with an earlier one for the same id)."""
        if check_id not in CHECKS:
            raise KeyError(f"unknown check id {check_id!r}")
        new = Finding(check_id, CHECKS[check_id], status, detail, fix, list(evidence or []))
        old = self._by_id.get(check_id)
        if old is None:
            self._by_id[check_id] = new
            return new
        keep, other = (new, old) if _RANK[new.status] > _RANK[old.status] else (old, new)
        keep.evidence = [*keep.evidence, *(e for e in other.evidence if e not in keep.evidence)]
        if keep.fix is None:
            keep.fix = other.fix
        self._by_id[check_id] = keep
        return keep

    def annotate(self, check_id: str, note: str) -> None:
        """Append ``note`` to a failed or warned finding's detail (a cause found later)."""
        found = self._by_id.get(check_id)
        if found is not None and found.status in (Status.FAIL, Status.WARN) and note not in found.detail:
            found.detail = f"{found.detail} ({note})"

    def status(self, check_id: str) -> Status | None:
        """The recorded status of ``check_id`` (None if not recorded yet)."""
        found = self._by_id.get(check_id)
        return found.status if found is not None else None

    def skip(self, check_id: str, why: str) -> None:
        """Record ``check_id`` as skipped unless a result exists already."""
        if check_id not in self._by_id:
            self.add(check_id, Status.SKIPPED, why)

    def ordered(self) -> list[Finding]:
        """Findings in the CHECKS order."""
        return [self._by_id[k] for k in CHECKS if k in self._by_id]
