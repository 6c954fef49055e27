"""The router's side of the reuse rule: block sizes, what to inject, what to keep with a handle.

``ReuseGuard`` applies the rule to a claimed handle (knowing each D engine's block size, from
``--block-size``, the connector's digest, or inferred from the handles seen), builds the coverage
stored with the next handle from what the turn observed, and asks P's ``/tokenize`` in token-exact
mode.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdiag.router.config import RouterConfig
from kvdiag.router.reply import Observed
from kvdiag.router.reuse_rule import (
    CHAT,
    COMPLETION,
    BlockSizeBook,
    Coverage,
    Decision,
    Part,
    PromptView,
    ReplyRecord,
    Reuse,
    TokenTrace,
    continuation_digest,
    decide,
    has_think_tag,
    next_rungs,
    request_options,
    token_trace,
    trim_handle,
)
from kvdiag.router.shared_prefix import SharedPrefixCounter, boundary_to_learn, consistent, with_count
from kvdiag.router.store import Handle
from kvdiag.router.upstream import Upstreams
from kvdiag.schema.verdicts import TrimReason

_logger = logging.getLogger(__name__)

# What /tokenize renders like the chat request itself; a request with a field outside this list
# (reasoning_effort, documents, a named tool_choice, ...) may render differently, so its tokens are
# not proven that way.
_TOKENIZE_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                         "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")
_TOKENIZE_COMPLETION_FIELDS = ("model", "prompt", "add_special_tokens")
_RENDER_ONLY_FIELDS = ("reasoning_effort", "documents", "response_format")


def tokenize_body(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` request that renders ``body``'s prompt; None when it would not render alike."""
    if any(body.get(name) is not None for name in _RENDER_ONLY_FIELDS):
        return None
    if body.get("tool_choice") not in (None, "auto", "none"):
        return None
    names = _TOKENIZE_CHAT_FIELDS if "messages" in body else _TOKENIZE_COMPLETION_FIELDS
    return {name: body[name] for name in names if name in body}


@dataclass(frozen=True, slots=True)
class Injection:
    """The reuse decision for a claimed handle and the params to send P (None: no handle)."""

    decision: Decision
    params: dict[str, Any] | None
    handle_tokens: int | None


@dataclass(frozen=True, slots=True)
class Learned:
    """What asking for a shared prefix's token count gave: the new injection, and the coverage it used."""

    injection: Injection
    coverage: Coverage | None  # with the learned count (None: unchanged)
    outcome: str               # shared_prefix.OUTCOMES


class ReuseGuard:
    """Per-process reuse state: the block-size book and the shared-prefix token counts."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.blocks = BlockSizeBook()
        self.prefixes = SharedPrefixCounter(config.shared_prefix_timeout)

    def observe(self, params: Mapping[str, Any] | None) -> None:
        """Learn an engine's block size from params it returned (D's handle or P's)."""
        if params is not None:
            self.blocks.observe(params.get("remote_engine_id"), params)

    def block_size(self, params: Mapping[str, Any], coverage: Coverage | None) -> int | None:
        """D's block size for a handle: the flag, the connector's digest, the stored value, or inferred."""
        if self.config.block_size is not None:
            return self.config.block_size
        digest = params.get("kvdiag_digest")
        exact = digest.get("block_size") if isinstance(digest, dict) else None
        if isinstance(exact, int) and not isinstance(exact, bool) and exact > 0:
            return exact
        if coverage is not None and coverage.block_size is not None:
            return coverage.block_size
        return self.blocks.block_size(params.get("remote_engine_id"))

    def inject(self, handle: Handle, view: PromptView | None, matched_tokens: int | None = None,
               prompt_len: int | None = None) -> Injection:
        """Decide how much of ``handle`` the new prompt may read; cut the params accordingly.

        ``matched_tokens`` / ``prompt_len`` (token-exact mode): leading tokens of the new prompt
        proven equal to D's sequence, and the new prompt's length in tokens.
        """
        params = handle.params
        num_tokens = params.get("remote_num_tokens")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            return Injection(Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE,
                                      "D's handle carries no remote_num_tokens"), None, None)
        bs = self.block_size(params, handle.coverage)
        decision = decide(handle.coverage, view, handle_tokens=num_tokens, block_size=bs,
                          margin=self.config.template_margin_tokens)
        if matched_tokens is not None and prompt_len is not None:
            decision = _token_decision(decision, matched_tokens, prompt_len, num_tokens, bs)
        if decision.reuse is Reuse.FULL:
            return Injection(decision, dict(params), num_tokens)
        if decision.reuse is Reuse.TRIMMED and bs is not None:
            cut = trim_handle(params, decision.limit_tokens, bs)
            if cut is not None:
                return Injection(decision, cut, num_tokens)
            decision = Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE,
                                f"{decision.detail}; D's block list cannot be cut by position (block size {bs})",
                                decision.rung, decision.matched)
        return Injection(decision, None, num_tokens)

    async def learn(self, upstreams: Upstreams, index: int, handle: Handle, view: PromptView | None,
                    injection: Injection, body: Mapping[str, Any], headers: dict[str, str],
                    tenant: str) -> Learned | None:
        """Inject more when the prompt diverges at a clean boundary whose token count P's /tokenize gives.

        None when there is nothing to learn; otherwise the outcome, and a new injection when the
        count was learned (else ``injection``, today's decision).
        """
        coverage = handle.coverage
        rung = boundary_to_learn(coverage, view, injection.decision)
        if rung is None or coverage is None or view is None:
            return None
        count, outcome = await self.prefixes.count(upstreams, index, body, headers, tenant, view, coverage.rungs[rung])
        if count is None:
            return Learned(injection, None, outcome)
        if not consistent(coverage, rung, count):
            _logger.warning("/tokenize counted %d tokens for a prefix a longer turn boundary holds fewer of; "
                            "not used", count)
            return Learned(injection, None, "inconsistent")
        learned = with_count(coverage, rung, count)
        again = self.inject(dataclasses.replace(handle, coverage=learned), view)
        # A generation prompt can count more than the message after it, so a lower boundary may still win.
        better = again.params is not None and again.decision.limit_tokens > injection.decision.limit_tokens
        return Learned(again if better else injection, learned, outcome)

    async def tokenize(self, upstreams: Upstreams, index: int, body: Mapping[str, Any],
                       headers: dict[str, str]) -> list[int] | None:
        """P's token ids of this prompt (token-exact mode); None when /tokenize would not render it alike.

        Raises LegError when P cannot answer.
        """
        request = tokenize_body(body)
        if request is None:
            return None
        return await upstreams.tokenize(index, json.dumps(request).encode(), headers,
                                        min(self.config.prefill_timeout, 10.0))

    @staticmethod
    def same_tokens(tokenized: list[int] | None, observed: Observed | None, limit: int | None) -> bool:
        """False when /tokenize and the prompt D rendered differ within the ``limit`` tokens P read."""
        ids = observed.prompt_ids if observed is not None else None
        if tokenized is None or not limit or ids is None or tokenized[:limit] == ids[:limit]:
            return True
        _logger.warning("token-exact mode: /tokenize and the prompt D rendered differ within the %d tokens P read; "
                        "check that P and D render alike", limit)
        return False

    def coverage(self, *, body: Mapping[str, Any], view: PromptView, previous: Coverage | None,
                 decision: Decision | None, prompt_tokens: int | None, observed: Observed | None,
                 d_params: Mapping[str, Any], prompt_ids: list[int] | None = None) -> Coverage:
        """What the handle D just returned covers, for the next turn."""
        self.observe(d_params)
        record = reply_record(observed, body, view.kind)
        continuation = None
        if view.kind == COMPLETION and observed is not None and record.content_sha256 is not None:
            continuation = continuation_digest(body, observed.content)
        bs = self.block_size(d_params, None)
        trace = None
        if self.config.verify_tokens and observed is not None:
            trace = sequence_trace(prompt_ids if prompt_ids is not None else observed.prompt_ids, observed,
                                   d_params.get("remote_num_tokens"), bs)
        rungs = next_rungs(previous, decision, view, prompt_tokens, clean=self.config.tokenize_shared_prefix)
        last_query = view.last_query if view.kind == CHAT else None
        return Coverage(view.kind, rungs, record, continuation, bs, trace, last_query)


def reply_record(observed: Observed | None, body: Mapping[str, Any], kind: str) -> ReplyRecord:
    """The :class:`ReplyRecord` of what D returned (``observed``) for request ``body``."""
    options = request_options(body)
    if observed is None:
        return ReplyRecord(None, options=options)
    text = observed.content
    parts = set(observed.parts)
    if kind == CHAT and has_think_tag(text):
        parts.add(Part.THINK_TAG)
    data = text.encode("utf-8", "surrogatepass")
    readable = not observed.unreadable and observed.malformed is None
    return ReplyRecord(hashlib.sha256(data).hexdigest() if readable else None, len(data), frozenset(parts),
                       options, observed.finish_reason, observed.stop_reason, observed.stop_reason_seen,
                       observed.completion_tokens, max(len(observed.indexes), 1))


def sequence_trace(prompt_ids: list[int] | None, observed: Observed, num_tokens: Any,
                   block_size: int | None) -> TokenTrace | None:
    """The token trace of D's sequence (prompt ids then output ids), cut to the tokens D holds KV for."""
    if prompt_ids is None or observed.output_ids is None or not observed.ids_complete:
        return None
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        return None
    ids = [*prompt_ids, *observed.output_ids]
    if len(ids) < num_tokens or not all(isinstance(i, int) and 0 <= i < 1 << 32 for i in ids):
        return None
    return token_trace(ids, num_tokens, block_size or 16)


def _token_decision(text: Decision, matched: int, prompt_len: int, num_tokens: int, bs: int | None) -> Decision:
    """Token-exact mode: the proven token prefix decides; the text rule only names the reason."""
    if matched >= num_tokens and prompt_len > num_tokens:
        return Decision(Reuse.FULL, num_tokens, rung=text.rung, matched=text.matched,
                        detail="token-exact: D's whole sequence matches")
    if bs is None:
        return Decision(Reuse.NONE, 0, TrimReason.UNVERIFIABLE, "token-exact: D's block size is unknown",
                        text.rung, text.matched)
    # P must compute at least one token, and never read past its own prompt.
    limit = min(matched, num_tokens, prompt_len - 1) // bs * bs
    text_limit = text.limit_tokens if text.reuse is not Reuse.NONE else 0
    reason = text.reason if text.reason is not None and limit >= text_limit else TrimReason.TOKEN_MISMATCH
    detail = f"token-exact: {matched} leading tokens match D's sequence of {num_tokens}"
    if limit < bs:
        return Decision(Reuse.NONE, 0, reason, detail + "; less than one block", text.rung, text.matched)
    if limit >= num_tokens:
        return Decision(Reuse.FULL, num_tokens, rung=text.rung, matched=text.matched, detail=detail)
    return Decision(Reuse.TRIMMED, limit, reason, detail, text.rung, text.matched)
