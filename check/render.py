"""The human form of a CheckReport: one block per check, wrapped to the terminal, never wider than it.

Usage::

    text = render_text(report, width=80)              # evidence for failures and warnings only
    text = render_text(report, width=120, verbose=True)
"""

from __future__ import annotations

import textwrap
from typing import Final

from kvdiag.check.findings import CheckReport, Finding, Status

TAGS: Final = {Status.PASS: "pass", Status.FAIL: "FAIL", Status.WARN: "warn", Status.INFO: "info",
               Status.SKIPPED: "skip", Status.UNKNOWN: "  ? "}
INDENT: Final = " " * 6
MIN_WIDTH: Final = 40


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


def render_finding(finding: Finding, width: int, verbose: bool = False) -> list[str]:
    """The lines of one finding: tag and title, then what was seen, the fix, and (when it matters) the evidence."""
    lines = _wrap(f"{finding.title} [{finding.id}]", width, f"{TAGS[finding.status]}  ", INDENT)
    lines += _wrap(finding.detail, width, INDENT, INDENT)
    if finding.fix and finding.status in (Status.FAIL, Status.WARN, Status.UNKNOWN):
        lines += _wrap("fix: " + finding.fix, width, INDENT, INDENT + "     ")
    if finding.evidence and (verbose or finding.status in (Status.FAIL, Status.WARN)):
        for item in finding.evidence:
            lines += _wrap("seen: " + item, width, INDENT, INDENT + "      ")
    return lines


def summary_line(report: CheckReport, strict: bool = False) -> str:
    """``2 failed, 12 passed, 1 cannot tell -> exit 1``."""
    names = {"fail": "failed", "warn": "warned", "unknown": "cannot tell", "pass": "passed", "info": "info",
             "skipped": "skipped"}
    counts = report.counts()
    parts = [f"{counts[k]} {v}" for k, v in names.items() if counts.get(k)]
    return f"{', '.join(parts)} -> exit {report.exit_code(strict)}"


def render_text(report: CheckReport, width: int = 80, verbose: bool = False, strict: bool = False) -> str:
    """The whole report for a terminal ``width`` columns wide (at least 40)."""
    width = max(width, MIN_WIDTH)
    head = "kvdiag check: " + ", ".join(f"{k} {v}" for k, v in report.targets.items() if v)
    lines = _wrap(head, width, "", "  ")
    lines.append("")
    for finding in report.findings:
        if finding.status is Status.SKIPPED and not verbose:
            continue
        lines += render_finding(finding, width, verbose)
    skipped = [f.id for f in report.findings if f.status is Status.SKIPPED]
    if skipped and not verbose:
        lines += _wrap(f"skipped (see --verbose): {', '.join(skipped)}", width, "", "  ")
    for note in report.notes:
        lines += _wrap(f"note: {note}", width, "", "  ")
    lines.append(summary_line(report, strict))
    return "\n".join(lines) + "\n"
