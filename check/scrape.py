"""One /metrics scrape as a lookup table, and the difference between two scrapes.

Usage::

    before = Scrape.parse(text_before)
    after = Scrape.parse(text_after)
    after.total("vllm:nixl_xfer_time_seconds_count") - before.total(...)
    delta(before, after, "vllm:nixl_num_failed_transfers_total")
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvdiag.check.findings import CheckError


class ScrapeError(CheckError):
    """A /metrics body that is not the Prometheus text format."""


@dataclass(frozen=True)
class Scrape:
    """Samples of one scrape: ``{sample name: [(labels, value), ...]}``."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        """Parse the Prometheus text exposition format; raise ScrapeError naming the problem."""
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
        except (ValueError, TypeError, IndexError) as exc:
            raise ScrapeError(f"/metrics is not in the Prometheus text format: {exc}") from None
        return cls(out)

    def has(self, name: str) -> bool:
        """True if the scrape has a sample called ``name``."""
        return name in self.samples

    def total(self, name: str, **match: str) -> float | None:
        """Sum of ``name``'s samples whose labels include ``match``; None if the series is absent."""
        rows = self.samples.get(name)
        if rows is None:
            return None
        return sum(v for labels, v in rows if all(labels.get(k) == want for k, want in match.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed per value of ``label``."""
        out: dict[str, float] = {}
        for labels, v in self.samples.get(name, []):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + v
        return out

    def label_sets(self, name: str) -> Iterator[dict[str, str]]:
        """The label sets of ``name`` (info-style gauges such as vllm:cache_config_info)."""
        for labels, _ in self.samples.get(name, []):
            yield labels


def delta(before: Scrape, after: Scrape, name: str, **match: str) -> float | None:
    """How much ``name`` (summed over ``match``) moved between two scrapes; None if ``after`` lacks it."""
    now = after.total(name, **match)
    if now is None:
        return None
    return now - (before.total(name, **match) or 0.0)


def delta_by_label(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """Per value of ``label``, how much ``name`` moved (only values that moved)."""
    old = before.by_label(name, label)
    return {k: v - old.get(k, 0.0) for k, v in after.by_label(name, label).items() if v - old.get(k, 0.0) > 0}
