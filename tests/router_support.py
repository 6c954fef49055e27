"""Helpers for the router tests: a real redis-server on a free port, and a tiny scriptable P/D backend.

The backend speaks just enough of vLLM's OpenAI API for the router's flow tests (failures that the
emulated engines do not produce: mid-stream breaks, malformed SSE, frames split at odd places).
Integration tests against the real emulated engines live in test_router_sim.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    """Run the real ``redis-server`` binary on a free port; yield its URL; stop it afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make sysdeps` (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp), "--protected-mode", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def d_params(request_id: str, blocks: int = 3) -> dict[str, Any]:
    """What a bidirectional D returns at finish (Contract 1)."""
    return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": "d-engine-1", "remote_request_id": f"chatcmpl-{request_id}-abcd1234",
            "remote_host": "localhost", "remote_port": 5601, "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 41, "remote_blocks_expiry_time": 123456.789,
            "remote_registration_generation": 1, "transfer_mode": "pull"}


def p_params(request_id: str) -> dict[str, Any]:
    """What P returns for D (Contract 1)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[7, 8]],
            "remote_engine_id": "p-engine-1", "remote_request_id": f"chatcmpl-{request_id}-11112222",
            "remote_host": "localhost", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 30,
            "remote_blocks_expiry_time": None}


@dataclass
class FakeBackend:
    """A scriptable P+D: set the ``p_*`` / ``d_*`` attributes to change what the next request gets."""

    role: str
    p_status: int = 200
    p_finish: str = "length"
    p_cached_tokens: int = 0
    p_report: dict[str, Any] | None = None
    p_delay: float = 0.0
    p_malformed: bool = False  # answer HTTP 200 with a body that is not JSON
    d_mode: str = "ok"  # ok, no_key, null_params, error_event, break, malformed, no_done, split, hang, status
    d_status: int = 200
    d_chunks: int = 3
    d_delay: float = 0.0
    d_linger: float = 0.0  # seconds D keeps the stream open after [DONE] (a slow upstream close)
    models_status: int = 200  # what GET /v1/models answers (401: as vLLM with --api-key and no key)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    aborted: int = 0
    port: int = 0
    runner: web.AppRunner | None = None

    async def start(self) -> FakeBackend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        self.headers.append({k.title().replace("Id", "ID"): v for k, v in request.headers.items()})
        if self.models_status != 200:
            return web.json_response({"error": {"message": "no", "type": "x", "param": None,
                                                "code": self.models_status}}, status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": f"{self.role}-model", "object": "model"}]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.title().replace("Id", "ID"): v for k, v in request.headers.items()})
        rid = request.headers.get("X-Request-Id", "none")
        if self.role == "prefill":
            return await self._prefill(rid)
        return await self._decode(request, rid, body)

    async def _prefill(self, rid: str) -> web.Response:
        if self.p_delay:
            await asyncio.sleep(self.p_delay)
        if self.p_malformed:
            return web.Response(body=b'{"id": "chatcmpl-x", "choices": [', content_type="application/json")
        if self.p_status != 200:
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "code":
                                                self.p_status}}, status=self.p_status)
        params: dict[str, Any] | None = p_params(rid) if self.p_finish != "error" else None
        if self.p_report is not None:
            params = dict(params or {})
            params["kvdiag"] = self.p_report
        body = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                             "finish_reason": self.p_finish}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31,
                          "prompt_tokens_details": {"cached_tokens": self.p_cached_tokens}},
                "kv_transfer_params": params}
        return web.json_response(body)

    async def _decode(self, request: web.Request, rid: str, body: dict[str, Any]) -> web.StreamResponse:
        mode = self.d_mode
        if mode == "status":
            return web.json_response({"error": {"message": "decode boom", "code": self.d_status}},
                                     status=self.d_status)
        if not body.get("stream"):
            out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world"},
                                "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
                   "kv_transfer_params": None if mode == "null_params" else d_params(rid)}
            if mode == "malformed":
                return web.Response(body=b"{not json", content_type="application/json")
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.d_chunks):
                delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f"tok{i} "}
                await resp.write(_frame({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                         "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
                if self.d_delay:
                    await asyncio.sleep(self.d_delay)
            if mode == "hang":
                await asyncio.sleep(3600)
            if mode == "break":
                assert request.transport is not None
                request.transport.close()
                return resp
            if mode == "error_event":
                await resp.write(_frame({"error": {"message": "engine died", "type": "InternalServerError",
                                                   "code": 500}}))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if mode == "malformed":
                await resp.write(b'data: {"choices": [], "kv_transfer_params": {oops\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
            final: dict[str, Any] = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk",
                                     "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}
            if mode in ("ok", "split", "no_done"):
                final["kv_transfer_params"] = d_params(rid)
            elif mode == "null_params":
                final["kv_transfer_params"] = None
            data = _frame(final) + (b"" if mode == "no_done" else b"data: [DONE]\n\n")
            if mode == "split":
                # Split inside the key and inside the blank line that ends the frame.
                cut1 = data.index(b"kv_transfer") + 5
                cut2 = data.index(b"\n\n") + 1
                for piece in (data[:cut1], data[cut1:cut2], data[cut2:]):
                    await resp.write(piece)
                    await asyncio.sleep(0.01)
            else:
                await resp.write(data)
            if self.d_linger:
                await asyncio.sleep(self.d_linger)
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        return resp


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def fake_backends(n_prefill: int = 1, n_decode: int = 1) -> AsyncIterator[tuple[list[FakeBackend],
                                                                                    list[FakeBackend]]]:
    """Start ``n_prefill`` fake P and ``n_decode`` fake D; close them afterwards."""
    ps = [await FakeBackend("prefill").start() for _ in range(n_prefill)]
    ds = [await FakeBackend("decode").start() for _ in range(n_decode)]
    try:
        yield ps, ds
    finally:
        for b in ps + ds:
            await b.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of ``path``: a last line without its newline is one the writer's thread is still
    writing (the polls of wait_for meet it), and is left for the next read."""
    if not path.exists():
        return []
    whole = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """Poll ``predicate()`` until true (events are written by a background thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------------------------- vLLM-shaped stub
# A P+D pair that speaks vLLM 0.33's chat/completions API byte for byte (compact JSON, field order,
# nulls), renders chat prompts the way Qwen3's template does (earlier reasoning dropped, tool calls
# re-rendered from the structured message, a generation prompt), and keeps every D sequence's
# tokens so it can say, for each prefill, how many positions P would load KV for from tokens other
# than its own: vLLM reads min(remote_num_tokens, prompt) tokens and end-trims D's block list to
# the blocks it allocated, so position p of P's prompt gets D's block at the same distance from
# the end of the list.
# Markers, role names and "\n\n" are one token each, as in Qwen's tokenizer (so a generation prompt
# costs what it costs there: 3 tokens, 7 with the empty think block); every other character is one.
SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "assistant", "user",
            "system", "tool", "\n\n")
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS) + "|.", re.S)
BLOCK = 16


def tokens(text: str) -> list[int]:
    """A tokenizer for the stub: each of SPECIALS is one token, every other character one token."""
    return [100_000 + SPECIALS.index(t) if t in SPECIALS else ord(t) for t in _SPECIAL_RE.findall(text)]


def render_tool_call(call: dict[str, Any]) -> str:
    fn = call.get("function") or call
    args = fn.get("arguments")
    args_obj = json.loads(args) if isinstance(args, str) else args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args_obj}) + "\n</tool_call>"


def render_chat(body: dict[str, Any]) -> str:
    """Qwen3-like: reasoning of assistant messages before the last user query dropped; think tags split off."""
    messages = body["messages"]
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out = []
    if body.get("tools"):
        out.append("<|im_start|>system\n# Tools\n" + json.dumps(body["tools"]) + "<|im_end|>\n")
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m.get("role") == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].split("<think>")[-1]
                content = content.split("</think>")[-1].lstrip("\n")
            text = content
            if i > last_user and reasoning:
                text = "<think>\n" + reasoning + "\n</think>\n\n" + content
            for call in m.get("tool_calls") or []:
                text += ("\n" if text else "") + render_tool_call(call)
            out.append("<|im_start|>assistant\n" + text + "<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{m.get('role')}\n{content}<|im_end|>\n")
    if body.get("add_generation_prompt", True):
        out.append("<|im_start|>assistant\n")
        if (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)


def prompt_tokens_of(body: dict[str, Any]) -> list[int]:
    return tokens(render_chat(body)) if "messages" in body else tokens(str(body.get("prompt", "")))


@dataclass
class Reply:
    """What D generates for a turn, and how it shows it (vLLM 0.33 with or without a reasoning parser)."""

    content: str | None = "The answer is 42."
    reasoning: str | None = None       # generated as <think>…</think>; streamed per ``reasoning_field``
    reasoning_field: str = "reasoning"  # "reasoning" (vLLM >= 0.11), "reasoning_content" (older)
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    finish_reason: str = "stop"
    stop_reason: str | int | None = None
    generated_extra: str = ""          # tokens D generated that no field shows (a stop string)

    def generated_text(self) -> str:
        text = ""
        if self.reasoning is not None:
            text += "<think>\n" + self.reasoning + "\n</think>\n\n"
        text += self.content or ""
        for call in self.tool_calls or []:
            fn = call["function"]
            text += '<tool_call>\n{"name":"' + fn["name"] + '","arguments":' + fn["arguments"] + "}\n</tool_call>"
        if self.function_call is not None:
            text += json.dumps(self.function_call)
        text += self.refusal or ""
        return text + self.generated_extra + "<|im_end|>"


@dataclass
class PrefillSeen:
    """One request P received: its params and what vLLM would have loaded."""

    params: dict[str, Any]
    prompt: list[int]
    read_tokens: int = 0
    wrong_kv_tokens: int = 0


@dataclass
class VllmStub:
    """Scriptable vLLM-shaped P (``/v1/...`` with do_remote_decode) and D (do_remote_prefill), one server."""

    block_size: int = BLOCK
    reply: Reply = field(default_factory=Reply)
    model: str = "Qwen/Qwen3-32B"
    sequences: dict[str, list[int]] = field(default_factory=dict)  # D's request id -> tokens D holds
    prefills: list[PrefillSeen] = field(default_factory=list)
    decodes: list[dict[str, Any]] = field(default_factory=list)
    tokenize_calls: int = 0
    port: int = 0
    runner: web.AppRunner | None = None
    _n: int = 0

    async def start(self) -> VllmStub:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def last_prefill(self) -> PrefillSeen:
        return self.prefills[-1]

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenize_calls += 1
        ids = prompt_tokens_of(body)
        return web.json_response({"count": len(ids), "max_model_len": 131072, "tokens": ids, "token_strs": None})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        rid = request.headers.get("X-Request-Id", "x")
        chat = "messages" in body
        prompt = prompt_tokens_of(body)
        if params.get("do_remote_decode"):
            return web.json_response(self._prefill(body, params, prompt, rid, chat))
        self.decodes.append(body)
        return await self._decode(request, body, prompt, rid, chat)

    def _prefill(self, body: dict[str, Any], params: dict[str, Any], prompt: list[int], rid: str,
                 chat: bool) -> dict[str, Any]:
        seen = PrefillSeen(dict(params), prompt)
        d_seq = self.sequences.get(str(params.get("remote_request_id")))
        num = params.get("remote_num_tokens")
        blocks = params.get("remote_block_ids")
        if d_seq is not None and isinstance(num, int) and blocks:
            bs = self.block_size
            count = min(num, len(prompt))  # vLLM: min(remote_num_tokens, prompt) - local hits (none here)
            if count >= len(prompt):
                count = len(prompt) - 1  # the last prompt token is always computed
            local = -(-count // bs)
            group = blocks[0][-local:] if local else []
            seen.read_tokens = count
            for pos in range(count):
                d_block = group[pos // bs]
                d_pos = d_block * bs + pos % bs  # the stub's D lays its blocks out in order from 0
                if d_pos >= len(d_seq) or d_seq[d_pos] != prompt[pos]:
                    seen.wrong_kv_tokens += 1
        self.prefills.append(seen)
        n_blocks = -(-len(prompt) // self.block_size)
        out_params = {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_block_ids": [list(range(1000, 1000 + n_blocks))], "remote_engine_id": "stub-p",
                      "remote_request_id": f"cmpl-{rid}-p", "remote_host": "127.0.0.1", "remote_port": 1,
                      "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(prompt),
                      "remote_blocks_expiry_time": None, "remote_registration_generation": 1,
                      "transfer_mode": "pull"}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 1, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if chat:
            msg = {"role": "assistant", "content": "x", "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}
            choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                      "token_ids": None}
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1, "model": self.model,
                    "choices": [choice], "usage": usage, "prompt_token_ids": None, "kv_transfer_params": out_params}
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "token_ids": None, "prompt_token_ids": None}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1, "model": self.model,
                "choices": [choice], "usage": usage, "kv_transfer_params": out_params}

    def _d_params(self, rid: str, seq: list[int]) -> dict[str, Any]:
        self._n += 1
        d_id = f"chatcmpl-{rid}-d{self._n}"
        num = len(seq) - 1  # D holds KV for every token but the last one sampled
        self.sequences[d_id] = seq[:num]
        return {"do_remote_prefill": False, "do_remote_decode": True,
                "remote_block_ids": [list(range(-(-num // self.block_size)))], "remote_engine_id": "stub-d",
                "remote_request_id": d_id, "remote_host": "127.0.0.1", "remote_port": 2, "tp_size": 1,
                "dcp_size": 1, "pp_size": 1, "remote_num_tokens": num, "remote_blocks_expiry_time": 12345.5,
                "remote_registration_generation": 1, "transfer_mode": "pull"}

    def _shown(self, body: dict[str, Any]) -> Reply:
        r = self.reply
        if body.get("include_reasoning") is False:
            return Reply(r.content, None, r.reasoning_field, r.tool_calls, r.function_call, r.refusal,
                         r.finish_reason, r.stop_reason)
        return r

    async def _decode(self, request: web.Request, body: dict[str, Any], prompt: list[int], rid: str,
                      chat: bool) -> web.StreamResponse:
        reply = self.reply
        generated = tokens(reply.generated_text())
        seq = prompt + generated
        params = self._d_params(rid, seq)
        shown = self._shown(body)
        ids = body.get("return_token_ids")
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(seq), "completion_tokens": len(generated)}
        if not body.get("stream"):
            return web.json_response(self._full(rid, chat, shown, generated if ids else None,
                                                prompt if ids else None, usage, params))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in self._frames(rid, chat, shown, generated, prompt, bool(ids), usage, params, body):
            await resp.write(frame)
        await resp.write_eof()
        return resp

    def _full(self, rid: str, chat: bool, shown: Reply, gen_ids: list[int] | None, prompt_ids: list[int] | None,
              usage: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        if not chat:
            choice = {"index": 0, "text": shown.content or "", "logprobs": None, "finish_reason": shown.finish_reason,
                      "stop_reason": shown.stop_reason, "token_ids": gen_ids, "prompt_logprobs": None,
                      "prompt_token_ids": prompt_ids}
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": 1, "model": self.model,
                    "choices": [choice], "usage": usage, "kv_transfer_params": params}
        msg: dict[str, Any] = {"role": "assistant", "content": shown.content, "refusal": shown.refusal,
                               "annotations": None, "audio": None, "function_call": shown.function_call}
        if shown.tool_calls:
            msg["tool_calls"] = shown.tool_calls
        msg[shown.reasoning_field] = shown.reasoning
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": shown.finish_reason,
                  "stop_reason": shown.stop_reason, "token_ids": gen_ids}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": 1, "model": self.model,
                "choices": [choice], "usage": usage, "prompt_token_ids": prompt_ids, "kv_transfer_params": params}

    def _frames(self, rid: str, chat: bool, shown: Reply, generated: list[int], prompt: list[int], ids: bool,
                usage: dict[str, Any], params: dict[str, Any], body: dict[str, Any]) -> list[bytes]:
        head = {"id": f"chatcmpl-{rid}" if chat else f"cmpl-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": 1, "model": self.model}
        out: list[bytes] = []
        deltas: list[dict[str, Any]] = []
        if shown.reasoning is not None:
            deltas += [{shown.reasoning_field: w} for w in _words(shown.reasoning)]
        deltas += [{"content": w} for w in _words(shown.content or "")]
        for i, call in enumerate(shown.tool_calls or []):
            fn = call["function"]
            deltas.append({"tool_calls": [{"id": call["id"], "type": "function", "index": i,
                                           "function": {"name": fn["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        if shown.function_call is not None:
            deltas.append({"function_call": shown.function_call})
        if shown.refusal is not None:
            deltas.append({"refusal": shown.refusal})
        per = max(len(generated) // max(len(deltas), 1), 1)
        if chat:
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}],
                     "prompt_token_ids": prompt if ids else None, "prompt_text": None}
            out.append(_compact(first))
        for n, delta in enumerate(deltas):
            chunk_ids = generated[n * per:(n + 1) * per] if n < len(deltas) - 1 else generated[n * per:-1]
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                                          "token_ids": chunk_ids if ids else None}
            else:
                choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "prompt_token_ids": (prompt if ids else None) if n == 0 else None,
                          "token_ids": chunk_ids if ids else None, "weight_versions": None}
            out.append(_compact({**head, "choices": [choice], "kv_transfer_params": None}))
        last_ids = generated[-1:] if ids else None
        if chat:
            final = {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": shown.finish_reason,
                     "stop_reason": shown.stop_reason, "token_ids": last_ids, "weight_versions": None}
        else:
            final = {"index": 0, "text": "", "logprobs": None, "finish_reason": shown.finish_reason,
                     "stop_reason": shown.stop_reason, "prompt_token_ids": None, "token_ids": last_ids,
                     "weight_versions": None}
        out.append(_compact({**head, "choices": [final], "kv_transfer_params": params}))
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append(_compact({**head, "choices": [], "usage": usage}))
        out.append(b"data: [DONE]\n\n")
        return out


def _words(text: str) -> list[str]:
    return re.findall(r"\S*\s*", text)[:-1] or ([text] if text else [])


def _compact(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
