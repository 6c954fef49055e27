"""The direct probe of P and D: the check plays the router for a short conversation and watches both engines.

Turn 1: P prefills with the router's miss params, D decodes with P's params (streaming), and the
final SSE chunk shows whether D streams ``kv_transfer_params`` and whether it returns its blocks.
Turn 2: P gets D's handle, as the router would inject it, and P's ``/metrics`` (``vllm:nixl_*``,
external prefix-cache hits, the instrumented connector's outcome) show whether a D->P read happened
and how it ended. A last P request reads D's turn-2 blocks back, so nothing stays held on D beyond
P's short lease.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from kvdiag.check.client import Client, Reply, StreamReply, error_message
from kvdiag.check.conversation import Conversation
from kvdiag.check.facts import (
    EXPIRY_SAFETY_MARGIN_S,
    BlockSizeRange,
    block_size_range,
    handle_observation,
    ranges_agree,
    ttl_from_expiry,
)
from kvdiag.check.findings import Findings, Status, Unreachable
from kvdiag.check.scrape import Scrape, delta, delta_by_label
from kvdiag.check.sidechannel import SideChannelError, remote_clock

CHAT: Final = "/v1/chat/completions"
# The router's params for a turn without a handle (vLLM's disagg proxy examples).
MISS_PARAMS: Final = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
REPORT_KEY: Final = "kvdiag"

XFER_COUNT: Final = "vllm:nixl_xfer_time_seconds_count"
XFER_BYTES: Final = "vllm:nixl_bytes_transferred_sum"
FAILED: Final = "vllm:nixl_num_failed_transfers_total"
EXPIRED: Final = "vllm:nixl_num_kv_expired_reqs_total"
EXTERNAL_HITS: Final = "vllm:external_prefix_cache_hits_total"
BY_SOURCE: Final = "vllm:prompt_tokens_by_source_total"
PREFIX_HITS: Final = "vllm:prefix_cache_hits_total"
CONNECTOR_READ: Final = "kvdiag_connector_remote_read_tokens_total"
CONNECTOR_REQUESTS: Final = "kvdiag_connector_requests_total"
CACHE_INFO: Final = "vllm:cache_config_info"

FIX_BIDIR_P: Final = ('start P with "bidirectional_kv_xfer": true in --kv-transfer-config\'s '
                      "kv_connector_extra_config (vLLM PR #32553); both P and D need it")
FIX_BIDIR_D: Final = ('start D with "bidirectional_kv_xfer": true in --kv-transfer-config\'s '
                      "kv_connector_extra_config, so D keeps a finished turn's blocks and returns where they are")
FIX_STREAM: Final = ("run D on a vLLM with PR #40186 (the final SSE chunk carries kv_transfer_params), or have "
                     "clients send non-streaming requests; until then every streamed turn loses reuse")


@dataclass
class EngineFacts:
    """What the direct probe learnt that the router checks need."""

    model: str | None = None
    decode_ttl: float | None = None
    prefix_caching: bool | None = None
    p_blocks: list[tuple[int, int]] = field(default_factory=list)
    d_blocks: list[tuple[int, int]] = field(default_factory=list)
    p_block_size: int | None = None
    d_block_size: int | None = None


def host_of(url: str) -> str:
    """The host part of a base URL (what the router writes into ``remote_host``)."""
    return urlsplit(url).hostname or "localhost"


def models_of(reply: Reply) -> list[str]:
    """The model ids of a /v1/models answer."""
    data = reply.body.get("data") if isinstance(reply.body, dict) else None
    return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _cache_info(scrape: Scrape | None) -> dict[str, str]:
    if scrape is None:
        return {}
    return next(iter(scrape.label_sets(CACHE_INFO)), {})


def _cached_tokens(body: Any) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _prompt_tokens(body: Any) -> int | None:
    usage = body.get("usage") if isinstance(body, dict) else None
    value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finish(body: Any) -> str | None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return str(reason) if reason is not None else None
    return None


def _content(body: Any) -> str:
    choices = body.get("choices") if isinstance(body, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        if isinstance(msg, dict) and isinstance(msg.get("content"), str):
            return str(msg["content"])
    return ""


def _is_handle(params: Any) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_decode")) and handle_observation(params) is not None


@dataclass
class EngineProbe:
    """One direct probe of P (``p``) and D (``d``) base URLs."""

    client: Client
    p: str
    d: str
    findings: Findings
    model_wanted: str | None = None
    reply_tokens: int = 96
    metrics_wait: float = 3.0
    side_channel_timeout: float = 3.0
    facts: EngineFacts = field(default_factory=EngineFacts)
    p_scrape: Scrape | None = None
    d_scrape: Scrape | None = None

    # --- discovery ----------------------------------------------------------------------------
    async def discover(self) -> bool:
        """/v1/models and /metrics of both engines; the models check. False if no common model."""
        p_models = await self._models("prefill", self.p)
        d_models = await self._models("decode", self.d)
        self.p_scrape = await self.client.scrape("prefill", self.p)
        self.d_scrape = await self.client.scrape("decode", self.d)
        for name, url, scrape in (("prefill", self.p, self.p_scrape), ("decode", self.d, self.d_scrape)):
            self.findings.add(f"{name}_reachable", Status.PASS if scrape is not None else Status.WARN,
                              f"{url} answers" + ("" if scrape is not None else "; /metrics is missing or not "
                                                  "Prometheus text, so counters cannot be read"),
                              None if scrape is not None else "expose vLLM's /metrics on the API port")
        common = [m for m in p_models if m in d_models]
        if self.model_wanted is not None:
            missing = [n for n, ms in (("P", p_models), ("D", d_models)) if self.model_wanted not in ms]
            if missing:
                self.findings.add("models", Status.FAIL, f"{' and '.join(missing)} do not serve "
                                  f"{self.model_wanted!r} (P: {', '.join(p_models) or 'none'}; D: "
                                  f"{', '.join(d_models) or 'none'})",
                                  "start P and D with the same model and --served-model-name, or pass --model")
                return False
            self.facts.model = self.model_wanted
        elif not common:
            self.findings.add("models", Status.FAIL, f"P serves {', '.join(p_models) or 'nothing'}, D serves "
                              f"{', '.join(d_models) or 'nothing'}: no model in common, so D cannot use P's KV",
                              "start P and D with the same model (and --served-model-name)")
            return False
        else:
            self.facts.model = common[0]
        self.findings.add("models", Status.PASS, f"P and D serve {self.facts.model}")
        return True

    async def _models(self, component: str, base: str) -> list[str]:
        reply = await self.client.get(component, base + "/v1/models")
        if reply.status != 200:
            raise Unreachable(component, base, f"GET /v1/models answered HTTP {reply.status}")
        return models_of(reply)

    # --- P's prefix cache -------------------------------------------------------------------------
    async def prefix_caching(self) -> None:
        """Send one plain prompt twice to P: a second answer with cached tokens means P's prefix cache is on."""
        info = _cache_info(self.p_scrape).get("enable_prefix_caching")
        prompt = Conversation.plain(secrets.token_hex(6))
        before = await self.client.scrape("prefill", self.p)
        replies = []
        for i in (1, 2):
            replies.append(await self.client.post_json(
                "prefill", self.p + CHAT, {"model": self.facts.model, "messages": prompt, "max_tokens": 1},
                headers={"X-Request-Id": f"kvdiag-check-cache-{secrets.token_hex(4)}-{i}"}))
        after = await self.client.scrape("prefill", self.p)
        evidence = []
        cached = _cached_tokens(replies[1].body) if replies[1].status == 200 else None
        hits = delta(before, after, PREFIX_HITS) if before is not None and after is not None else None
        state: bool | None = None
        if info:
            state = info.lower() == "true"
            evidence.append(f'P: {CACHE_INFO}{{enable_prefix_caching="{info}"}}')
        if cached is not None:
            evidence.append(f"P: the same prompt sent twice: cached_tokens {cached} the second time")
            state = cached > 0 if state is None else state
        if hits is not None:
            evidence.append(f"P: {PREFIX_HITS} +{hits:g} over the two requests")
            state = hits > 0 if state is None else state
        self.facts.prefix_caching = state
        if state is None:
            self.findings.add("prefix_caching_prefill", Status.UNKNOWN,
                              "cannot tell: P reports neither cached_tokens (vLLM --enable-prompt-tokens-details) "
                              f"nor {PREFIX_HITS}", None, evidence)
        elif state:
            self.findings.add("prefix_caching_prefill", Status.INFO,
                              "on: P reads from D only what its own cache lacks (often just D's last reply), so "
                              "local_hit and below_threshold verdicts are normal", None, evidence)
        else:
            self.findings.add("prefix_caching_prefill", Status.INFO,
                              "off: every later turn reads its whole history back from D (the article's setup)",
                              None, evidence)

    # --- the conversation -------------------------------------------------------------------------
    async def _prefill(self, conv: Conversation, label: str, params: dict[str, Any]) -> Reply:
        body = {"model": self.facts.model, "messages": conv.messages, "max_tokens": 1, "stream": False,
                "kv_transfer_params": params}
        return await self.client.post_json("prefill", self.p + CHAT, body,
                                           headers={"X-Request-Id": conv.request_id(label)})

    def _decode_body(self, conv: Conversation, p_params: dict[str, Any], stream: bool, tokens: int) -> dict[str, Any]:
        params = {k: v for k, v in p_params.items() if k != REPORT_KEY}
        if "remote_host" in params:
            params["remote_host"] = host_of(self.p)  # as the router does
        body: dict[str, Any] = {"model": self.facts.model, "messages": conv.messages, "max_tokens": tokens,
                                "min_tokens": tokens, "stream": stream, "kv_transfer_params": params}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _handle_for_p(self, d_params: dict[str, Any]) -> dict[str, Any]:
        params = dict(d_params)
        params["do_remote_decode"], params["do_remote_prefill"] = True, False
        if "remote_host" in params:
            params["remote_host"] = host_of(self.d)  # as the router does
        return params

    async def conversation(self) -> None:
        """Turns 1 and 2 as the router would run them, judging each fact on the way."""
        conv = Conversation()
        p1 = await self._prefill(conv, "t1-p", dict(MISS_PARAMS))
        p1_params = p1.body.get("kv_transfer_params") if isinstance(p1.body, dict) else None
        if p1.status != 200 or not isinstance(p1_params, dict) or not p1_params.get("do_remote_prefill"):
            why = (f"HTTP {p1.status}: {error_message(p1)}" if p1.status != 200
                   else "P answered without kv_transfer_params for D")
            self.findings.add("pd_handoff", Status.FAIL, f"P's prefill with the router's params failed: {why}",
                              "run P with --kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": "
                              "\"kv_both\"}' (or kv_producer)")
            return
        self._observe("P", p1_params)
        d1 = await self.client.post_stream("decode", self.d + CHAT,
                                           self._decode_body(conv, p1_params, True, self.reply_tokens),
                                           headers={"X-Request-Id": conv.request_id("t1-d")})
        if d1.status != 200 or d1.error is not None or not d1.content:
            self.findings.add("pd_handoff", Status.FAIL, f"D's decode with P's params failed: {_stream_failure(d1)}",
                              "check D's log; P and D need the same model, block size and a NIXL path between them")
            await self._decode_block_list(conv)
            return
        self.findings.add("pd_handoff", Status.PASS, f"P prefilled, D decoded a {len(d1.content)}-character reply")
        d_params, reply, received = await self._streamed_params(conv, d1)
        if d_params is None:
            await self._decode_block_list(conv)
            return
        self._observe("D", d_params)
        await self._measure_ttl(d_params, received)
        conv.extend(reply)
        await self._turn2(conv, d_params)

    async def _streamed_params(self, conv: Conversation, d1: StreamReply
                               ) -> tuple[dict[str, Any] | None, str, float]:
        """D's params from the stream, or (stock vLLM) from a non-streaming retry of turn 1."""
        if d1.params_present:
            self.findings.add("stream_kv_params", Status.PASS,
                              "D's final SSE chunk carries kv_transfer_params")
            return self._decode_params(d1.params, d1.finish_reason), d1.content, d1.received_at
        self.findings.add("stream_kv_params", Status.FAIL,
                          f"D's stream ({d1.frames} chunks, finish_reason {d1.finish_reason}) has no "
                          "kv_transfer_params: streaming clients never hand the router D's blocks "
                          "(next turn: metadata_not_returned, reason not_streamed)", FIX_STREAM)
        # The non-streaming body always carries the params: it tells whether D is bidirectional.
        p1b = await self._prefill(conv, "t1b-p", dict(MISS_PARAMS))
        p_params = p1b.body.get("kv_transfer_params") if isinstance(p1b.body, dict) else None
        if p1b.status != 200 or not isinstance(p_params, dict):
            self.findings.skip("bidirectional_decode", "P's second prefill failed")
            return None, "", 0.0
        d1b = await self.client.post_json("decode", self.d + CHAT,
                                          self._decode_body(conv, p_params, False, self.reply_tokens),
                                          headers={"X-Request-Id": conv.request_id("t1b-d")})
        received = time.perf_counter()
        body_params = d1b.body.get("kv_transfer_params") if isinstance(d1b.body, dict) else None
        return self._decode_params(body_params, _finish(d1b.body)), _content(d1b.body), received

    def _decode_params(self, params: Any, finish: str | None) -> dict[str, Any] | None:
        if _is_handle(params):
            self.findings.add("bidirectional_decode", Status.PASS,
                              f"D returned its blocks ({len(params['remote_block_ids'][0])} blocks, "
                              f"{params['remote_num_tokens']} tokens) with do_remote_decode: true")
            return dict(params)
        if finish not in ("length", "stop"):
            self.findings.add("bidirectional_decode", Status.UNKNOWN,
                              f"cannot tell: D's reply ended with finish_reason {finish}, and D returns no blocks "
                              "for a request that did not finish normally")
        else:
            self.findings.add("bidirectional_decode", Status.FAIL,
                              f"D finished normally (finish_reason {finish}) but returned kv_transfer_params "
                              f"{_short(params)}: it does not keep turns for P to read back "
                              "(next turn: metadata_not_returned, reason bidirectional_off_on_decode)", FIX_BIDIR_D)
        for later in ("bidirectional_prefill", "d2p_read", "decode_ttl"):
            self.findings.skip(later, "blocked: D returned no blocks to read")
        return None

    async def _decode_block_list(self, conv: Conversation) -> None:
        """D's block list when D returned none: D prefills one prompt as P would (its blocks expire with the lease)."""
        if self.facts.d_blocks:
            return
        body = {"model": self.facts.model, "messages": conv.messages[:1], "max_tokens": 1, "stream": False,
                "kv_transfer_params": dict(MISS_PARAMS)}
        reply = await self.client.post_json("decode", self.d + CHAT, body,
                                            headers={"X-Request-Id": conv.request_id("blocks-d")})
        params = reply.body.get("kv_transfer_params") if isinstance(reply.body, dict) else None
        if reply.status == 200 and isinstance(params, dict):
            self._observe("D", params)

    def _observe(self, who: str, params: dict[str, Any]) -> None:
        obs = handle_observation(params)
        if obs is not None:
            (self.facts.p_blocks if who == "P" else self.facts.d_blocks).append(obs)

    async def _measure_ttl(self, d_params: dict[str, Any], received: float) -> None:
        expiry = d_params.get("remote_blocks_expiry_time")
        port = d_params.get("remote_port")
        if not isinstance(expiry, int | float) or isinstance(expiry, bool):
            self.findings.add("decode_ttl", Status.UNKNOWN,
                              "cannot tell: D's params carry no remote_blocks_expiry_time (a vLLM before the "
                              "clock-synced expiry), and D's TTL is not visible from outside otherwise")
            return
        if not isinstance(port, int) or isinstance(port, bool):
            self.findings.add("decode_ttl", Status.UNKNOWN, "cannot tell: D's params name no side-channel port")
            return
        host = host_of(self.d)
        try:
            clock = await remote_clock(self.client.session, host, port, self.side_channel_timeout)
        except SideChannelError as exc:
            self.findings.add("decode_ttl", Status.UNKNOWN,
                              f"cannot tell: D's side channel {host}:{port} gave no clock reading ({exc})",
                              "run the check where it can reach D's NIXL side-channel port, as P does")
            return
        ttl = ttl_from_expiry(float(expiry), clock.remote_now(), time.perf_counter() - received)
        self.facts.decode_ttl = ttl
        evidence = [f"D: remote_blocks_expiry_time {float(expiry):.3f} on D's clock; side channel "
                    f"{host}:{port} ({clock.protocol} handshake, round trip {clock.rtt * 1000:.1f} ms)"]
        if ttl <= EXPIRY_SAFETY_MARGIN_S:
            self.findings.add("decode_ttl", Status.FAIL,
                              f"D holds a finished turn's blocks for about {ttl:.1f} s, not above P's "
                              f"{EXPIRY_SAFETY_MARGIN_S:g} s expiry margin: P declines every D->P read",
                              "raise decoder_kv_blocks_ttl in D's kv_connector_extra_config (vLLM's default is "
                              "480 s) and keep the router's --entry-ttl below it minus 5 s", evidence)
        else:
            self.findings.add("decode_ttl", Status.PASS,
                              f"D holds a finished turn's blocks for about {ttl:.0f} s (measured {ttl:.2f} s)",
                              None, evidence)

    async def _turn2(self, conv: Conversation, d_params: dict[str, Any]) -> None:
        before = await self.client.scrape("prefill", self.p)
        try:
            p2 = await self._prefill(conv, "t2-p", self._handle_for_p(d_params))
        except Unreachable as exc:
            self.findings.add("d2p_read", Status.FAIL,
                              f"P's request with D's handle did not complete ({exc.reason}): vLLM 0.33 with "
                              "kv_load_failure_policy=recompute hangs in WAITING_FOR_REMOTE_KVS after a failed read",
                              "use kv_load_failure_policy=fail (the default), and fix the read failure itself")
            return
        after = await self._scrape_after(before)
        ReadJudge(self, d_params, p2, before, after).judge()
        p2_params = p2.body.get("kv_transfer_params") if isinstance(p2.body, dict) else None
        if p2.status == 200 and isinstance(p2_params, dict) and p2_params.get("do_remote_prefill"):
            self._observe("P", p2_params)
            await self._finish_turn2(conv, p2_params)

    async def _scrape_after(self, before: Scrape | None) -> Scrape | None:
        """P's counters after the read; vLLM publishes NIXL stats with the engine's next stats step."""
        deadline = time.monotonic() + self.metrics_wait
        while True:
            after = await self.client.scrape("prefill", self.p)
            if after is None or before is None or time.monotonic() > deadline:
                return after
            if any((delta(before, after, name) or 0) > 0 for name in (XFER_COUNT, FAILED, EXPIRED, CONNECTOR_REQUESTS)):
                return after
            await asyncio.sleep(0.1)

    async def _finish_turn2(self, conv: Conversation, p2_params: dict[str, Any]) -> None:
        """D decodes turn 2; P then reads D's turn-2 blocks back, so D holds nothing after the check."""
        d2 = await self.client.post_json("decode", self.d + CHAT, self._decode_body(conv, p2_params, False, 8),
                                         headers={"X-Request-Id": conv.request_id("t2-d")})
        d2_params = d2.body.get("kv_transfer_params") if isinstance(d2.body, dict) else None
        if d2.status != 200 or not isinstance(d2_params, dict) or not _is_handle(d2_params):
            return
        self._observe("D", d2_params)
        conv.extend(_content(d2.body))
        await self._prefill(conv, "t3-p", self._handle_for_p(d2_params))

    # --- block sizes --------------------------------------------------------------------------
    def block_sizes(self) -> None:
        """Compare the block sizes P's and D's block lists (or vllm:cache_config_info) imply."""
        p_range = self._range(self.p_scrape, self.facts.p_blocks)
        d_range = self._range(self.d_scrape, self.facts.d_blocks)
        self.facts.p_block_size, self.facts.d_block_size = p_range.best(), d_range.best()
        evidence = [f"P: {len(self.facts.p_blocks)} block list(s) {self.facts.p_blocks} (tokens, blocks)",
                    f"D: {len(self.facts.d_blocks)} block list(s) {self.facts.d_blocks} (tokens, blocks)"]
        unseen = [who for who, scrape, obs in (("P", self.p_scrape, self.facts.p_blocks),
                                               ("D", self.d_scrape, self.facts.d_blocks))
                  if not obs and "block_size" not in _cache_info(scrape)]
        if unseen:
            self.findings.add("block_size", Status.UNKNOWN,
                              f"cannot tell: no block list seen from {' and '.join(unseen)}", None, evidence)
            return
        agree = ranges_agree(p_range, d_range)
        if agree is False:
            self.findings.add("block_size", Status.FAIL,
                              f"P uses {p_range.describe()}-token blocks, D {d_range.describe()}-token blocks: "
                              "KV moved between them lands at the wrong token positions (or the transfer fails)",
                              "start P and D with the same --block-size", evidence)
            self.findings.annotate("pd_handoff", "likely cause: the block sizes differ (block_size)")
        elif agree is None:
            self.findings.add("block_size", Status.UNKNOWN,
                              f"cannot tell: P's blocks fit {p_range.describe()} tokens, D's {d_range.describe()}",
                              None, evidence)
        else:
            self.findings.add("block_size", Status.PASS, f"both use {p_range.describe()}-token blocks", None,
                              evidence)

    @staticmethod
    def _range(scrape: Scrape | None, obs: list[tuple[int, int]]) -> BlockSizeRange:
        size = _cache_info(scrape).get("block_size")
        if size and size.isdigit():
            return BlockSizeRange(int(size), int(size))
        return block_size_range(obs, slack_tokens=1)


@dataclass
class ReadJudge:
    """Turn 2's verdict on P: bidirectional on P, and whether the D->P read happened and succeeded."""

    probe: EngineProbe
    d_params: dict[str, Any]
    reply: Reply
    before: Scrape | None
    after: Scrape | None

    def _moved(self, name: str, **match: str) -> float | None:
        if self.before is None or self.after is None:
            return None
        return delta(self.before, self.after, name, **match)

    def evidence(self) -> list[str]:
        """Every P counter that moved (or stood still) during turn 2."""
        out = []
        for name, match in ((XFER_COUNT, {}), (XFER_BYTES, {}), (FAILED, {}), (EXPIRED, {}), (EXTERNAL_HITS, {}),
                            (BY_SOURCE, {"source": "external_kv_transfer"}), (CONNECTOR_READ, {})):
            moved = self._moved(name, **match)
            if moved is not None:
                shown = name + ('{source="external_kv_transfer"}' if match else "")
                out.append(f"P: {shown} {moved:+,.0f}" if abs(moved) >= 10_000 else f"P: {shown} {moved:+g}")
        cached = _cached_tokens(self.reply.body)
        if cached is not None:
            out.append(f"P: usage.prompt_tokens_details.cached_tokens {cached} of {_prompt_tokens(self.reply.body)}")
        if self.before is not None and self.after is not None:
            outcomes = delta_by_label(self.before, self.after, CONNECTOR_REQUESTS, "outcome")
            if outcomes:
                out.append(f"P: {CONNECTOR_REQUESTS} by outcome {outcomes}")
        return out

    def judge(self) -> None:
        """Record bidirectional_prefill and d2p_read."""
        add = self.probe.findings.add
        ev = self.evidence()
        body = self.reply.body
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        report = params.get(REPORT_KEY) if isinstance(params, dict) else None
        error = body.get("error") if isinstance(body, dict) else None
        if report is None and isinstance(error, dict):
            report = error.get(REPORT_KEY)  # vLLM answers a KV load failure with HTTP 500: the report rides there
        if self.reply.status != 200 and not isinstance(report, dict):
            failed, expired = self._moved(FAILED), self._moved(EXPIRED)
            if failed or expired:
                self._read_failed("expired" if expired else "transfer_failed", None, ev)
                return
            add("d2p_read", Status.FAIL, f"P answered HTTP {self.reply.status} to the turn with D's handle: "
                f"{error_message(self.reply)}", "check P's log for the request kvdiag-check-…-t2-p", ev)
            add("bidirectional_prefill", Status.UNKNOWN, "cannot tell: P's request with D's handle failed", None, ev)
            return
        if isinstance(report, dict) and isinstance(report.get("outcome"), str):
            self._from_report(report, ev)
            return
        self._from_counters(ev)

    def _from_report(self, report: dict[str, Any], ev: list[str]) -> None:
        add = self.probe.findings.add
        outcome = report["outcome"]
        reason = report.get("reason") or ""
        read = report.get("remote_read_tokens")
        ev = [*ev, f"P: instrumented report outcome {outcome}" + (f" ({reason})" if reason else "")]
        if outcome == "feature_disabled_on_prefill":
            add("bidirectional_prefill", Status.FAIL, "P ignored D's handle: bidirectional_kv_xfer is off on P",
                FIX_BIDIR_P, ev)
            self.probe.findings.skip("d2p_read", "blocked: P does not read from D")
            return
        add("bidirectional_prefill", Status.PASS, f"P acted on D's handle (outcome {outcome})", None, ev)
        if outcome == "remote_hit":
            add("d2p_read", Status.PASS, f"P read {read} tokens back from D "
                f"({report.get('transfer_bytes', 0)} bytes in {report.get('transfer_ms', 0):.1f} ms)", None, ev)
        elif outcome in ("expired_remote_read", "transfer_failed"):
            self._read_failed("expired" if outcome == "expired_remote_read" else "transfer_failed",
                              report.get("failure_type"), ev, reason)
        elif outcome in ("local_hit", "below_threshold"):
            add("d2p_read", Status.WARN, f"P read nothing from D ({outcome}: {reason or 'its own cache covered it'})",
                "rerun with a larger --reply-tokens than P's kv_recompute_threshold", ev)
        else:
            add("d2p_read", Status.UNKNOWN, f"cannot tell: P reported {outcome}" + (f" ({reason})" if reason else ""),
                None, ev)

    def _from_counters(self, ev: list[str]) -> None:
        add = self.probe.findings.add
        xfer, failed, expired = self._moved(XFER_COUNT), self._moved(FAILED), self._moved(EXPIRED)
        if xfer is None and failed is None:
            why = "cannot tell: P's /metrics has no vllm:nixl_* series"
            add("bidirectional_prefill", Status.UNKNOWN, why, None, ev)
            add("d2p_read", Status.UNKNOWN, why, None, ev)
            return
        if failed or expired:
            add("bidirectional_prefill", Status.PASS, "P tried to read D's blocks", None, ev)
            self._read_failed("expired" if expired else "transfer_failed", None, ev)
            return
        finish = _finish(self.reply.body)
        if xfer:
            add("bidirectional_prefill", Status.PASS, "P read D's blocks over NIXL", None, ev)
            external = [m for m in (self._moved(EXTERNAL_HITS), self._moved(CONNECTOR_READ),
                                    self._moved(BY_SOURCE, source="external_kv_transfer")) if m is not None]
            if finish not in ("length", "stop"):
                add("d2p_read", Status.FAIL, f"P's NIXL read ran but the request ended with finish_reason {finish}",
                    "check P's log for a KV load failure on the request kvdiag-check-…-t2-p", ev)
            elif external and not any(m > 0 for m in external):
                add("d2p_read", Status.WARN, "NIXL moved data but P counted no external prefix-cache hit tokens",
                    None, ev)
            else:
                add("d2p_read", Status.PASS, "P read D's blocks (vllm:nixl_* counters moved, "
                    + ("external-hit tokens rose)" if external else "no external-hit series on P)"), None, ev)
            return
        if finish not in ("length", "stop"):
            add("d2p_read", Status.FAIL, f"P's request with D's handle ended with finish_reason {finish} and no NIXL "
                "counter moved", "check P's log for 'Got invalid KVTransferParams' or a KV load failure", ev)
            add("bidirectional_prefill", Status.UNKNOWN, "cannot tell: P's request with D's handle failed", None, ev)
            return
        offered = self._offered_tokens()
        add("bidirectional_prefill", Status.FAIL,
            "P ignored D's handle: no D->P read, no NIXL counter moved"
            + (f", though about {offered} tokens were left beyond P's own cache" if offered is not None else "")
            + " (bidirectional_kv_xfer is off on P, or its kv_recompute_threshold is above that)", FIX_BIDIR_P, ev)
        self.probe.findings.skip("d2p_read", "blocked: P does not read from D")

    def _offered_tokens(self) -> int | None:
        """vLLM's D->P count for turn 2: min(D's tokens, prompt) - P's local hit."""
        prompt = _prompt_tokens(self.reply.body)
        cached = _cached_tokens(self.reply.body)
        obs = handle_observation(self.d_params)
        if prompt is None or cached is None or obs is None:
            return None
        return min(obs[0], prompt) - cached

    def _read_failed(self, kind: str, failure_type: Any, ev: list[str], reason: str = "") -> None:
        if kind == "expired":
            self.probe.findings.add(
                "d2p_read", Status.FAIL,
                "P declined or lost the read: D's blocks were expiring or gone (expired_remote_read)"
                + (f": {reason}" if reason else ""),
                "keep decoder_kv_blocks_ttl well above 5 s, the router's --entry-ttl below it minus 5 s, and give D "
                "enough KV memory that it does not evict retained blocks", ev)
            return
        kind_text = f" ({failure_type})" if failure_type else ""
        self.probe.findings.add(
            "d2p_read", Status.FAIL, f"P's NIXL read from D failed{kind_text}"
            + (f": {reason}" if reason else "") + " (vllm:nixl_num_failed_transfers rose)",
            "let P reach D's NIXL side channel (remote_host/remote_port in D's params; "
            "VLLM_NIXL_SIDE_CHANNEL_HOST), keep NIXL backends alike on P and D, and clear router state after D "
            "restarts", ev)


def _stream_failure(reply: StreamReply) -> str:
    if reply.status != 200:
        return f"HTTP {reply.status}: {reply.error_body[:200]}"
    if reply.error is not None:
        return reply.error
    if reply.finish_reason == "error":
        return "the request ended with finish_reason error before any text: D could not load P's KV"
    return f"an empty reply (finish_reason {reply.finish_reason})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
