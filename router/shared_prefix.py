"""The token count of the messages a diverging prompt shares with the previous one, from P's ``/tokenize``.

A turn boundary's token count comes from that turn's ``usage.prompt_tokens``. When a client edits a
message or compacts its history, the new prompt may reproduce the previous one only up to a
message boundary that no turn ended at: the end of the system prompt (an edited first user
message, a compaction), or a user query of a prompt that was itself edited. The rule records
those *clean* boundaries without a count; on the turn that diverges there, the router asks P's
``/tokenize`` for the rendering of the shared messages alone (no generation prompt), once per
tenant and prefix (a bounded LRU), and the rule then trims to that count like to any boundary
(margin, block rounding, never beyond D's handle).

A boundary is clean when the prefix ends with the leading system messages or with a user query:
there the template closes the message with its end-of-turn special token whatever follows, and
every reasoning trace before it renders alike in the prefix and in any longer prompt (templates
keep reasoning only after the last user query). A prefix ending with an assistant message is not
clean: Qwen3's template gives the final assistant message a ``<think>`` block it drops once the
message is followed by another one.

Usage::

    index = boundary_to_learn(coverage, view, decision)   # None: nothing to learn
    count, outcome = await counter.count(upstreams, p_index, body, headers, tenant, view, coverage.rungs[index])
    if count is not None and consistent(coverage, index, count):
        coverage = with_count(coverage, index, count)       # then decide again
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

from kvdiag.router.reuse_rule import CHAT, Coverage, Decision, PromptView, Reuse, Rung, trusted_length
from kvdiag.router.upstream import LegError, Upstreams
from kvdiag.schema.metrics import SHARED_PREFIX_OUTCOMES
from kvdiag.schema.verdicts import TrimReason

CACHE_ENTRIES: Final = 4096  # (tenant, prefix digest) -> token count; about 200 bytes each
# What the lookup of one boundary's count ended in (the metric's label values): a count from the
# cache or from P, or a fall back to the turn boundaries.
OUTCOMES: Final = SHARED_PREFIX_OUTCOMES

# What /tokenize renders like the chat request; a request with a field outside the list may render
# differently (gpt-oss puts reasoning_effort into the system message), so it is not counted that way.
_TOKENIZE_FIELDS: Final = ("model", "add_special_tokens", "chat_template", "chat_template_kwargs", "tools",
                           "mm_processor_kwargs", "media_io_kwargs")
_RENDER_ONLY_FIELDS: Final = ("reasoning_effort", "documents", "response_format")


def boundary_to_learn(coverage: Coverage | None, view: PromptView | None, decision: Decision) -> int | None:
    """The rung whose token count would let the rule inject more than ``decision``; None when there is none.

    It is the highest rung the prompt reproduces, above the rung the decision used, at a clean
    boundary of the prompt, trusted by the reasoning rule, and without a count.
    """
    if coverage is None or view is None or view.kind != CHAT or coverage.kind != CHAT:
        return None
    if decision.reuse is Reuse.FULL or decision.matched < 0 or decision.reason is TrimReason.UNVERIFIABLE:
        return None
    trusted = trusted_length(coverage, view)
    floor = decision.rung if decision.rung is not None else -1
    clean = set(view.clean)
    for index in range(min(decision.matched, len(coverage.rungs) - 1), floor, -1):
        rung = coverage.rungs[index]
        if rung.tokens is None and not rung.exact and rung.length in clean and rung.length <= trusted \
                and view.matches(rung):
            return index
    return None


def consistent(coverage: Coverage, index: int, count: int) -> bool:
    """False when ``count`` cannot be the prefix's: not positive, or above a longer prefix's known count."""
    return count > 0 and all(r.tokens is None or r.tokens >= count for r in coverage.rungs[index + 1:])


def with_count(coverage: Coverage, index: int, count: int) -> Coverage:
    """``coverage`` with rung ``index`` given ``count`` tokens."""
    rungs = list(coverage.rungs)
    rungs[index] = dataclasses.replace(rungs[index], tokens=count)
    return dataclasses.replace(coverage, rungs=tuple(rungs))


def tokenize_prefix_body(body: Mapping[str, Any], messages: list[Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` request rendering ``messages`` alone as ``body`` would, without a generation prompt."""
    if any(body.get(name) is not None for name in _RENDER_ONLY_FIELDS):
        return None
    if body.get("tool_choice") not in (None, "auto", "none"):
        return None
    out = {name: body[name] for name in _TOKENIZE_FIELDS if name in body}
    out["messages"] = messages
    out["add_generation_prompt"] = False
    return out


class SharedPrefixCounter:
    """Token counts of clean prefixes, learned from P's /tokenize and kept per tenant (bounded LRU)."""

    def __init__(self, timeout: float, capacity: int = CACHE_ENTRIES) -> None:
        self.timeout = timeout
        self.capacity = capacity
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    async def count(self, upstreams: Upstreams, index: int, body: Mapping[str, Any], headers: dict[str, str],
                    tenant: str, view: PromptView, rung: Rung) -> tuple[int | None, str]:
        """The token count of the prompt's first ``rung.length`` messages, and the outcome (:data:`OUTCOMES`)."""
        # The digest is seeded with the fields that shape the rendering (model, tools, template options).
        key = (tenant, rung.digest)
        found = self._counts.get(key)
        if found is not None:
            self._counts.move_to_end(key)
            return found, "cached"
        request = tokenize_prefix_body(body, list(view.messages[:rung.length]))
        if request is None:
            return None, "unrenderable"
        try:
            async with asyncio.timeout(self.timeout):
                ids = await upstreams.tokenize(index, json.dumps(request).encode(), headers, self.timeout + 1.0)
        except TimeoutError:
            return None, "timeout"
        except LegError:
            return None, "failed"
        self._counts[key] = len(ids)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return len(ids), "tokenized"
